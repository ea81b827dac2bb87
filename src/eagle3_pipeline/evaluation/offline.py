"""Offline simulated acceptance: the drafter chained on stored hidden states, as vLLM drafts.

At every draft start i (the last verified position), step k proposes the token at position
i + 2 + k. It is accepted when it equals the verifier's greedy token there (argmax over the FULL
target vocab of the verifier's lm_head on the stored final, pre-norm hidden state) and every
earlier step was accepted. The drafter's hidden state is chained through its TTT steps and the
token fed at step k is the sequence's token; for the verifier's own greedy answers that token is
the verifier's greedy token, i.e. exactly what vLLM feeds after k accepted drafts.

Two figures come out of the same drafts: `accepted_prefix` counts a draft at EVERY supervised
start (the whole-val figure), `served_walk` only at the starts vLLM reaches when it generates the
answer itself (after the prefill's token, then one past each verified run) while it owes
`max_new_tokens` tokens, each draft counted whole as vLLM's own counters count it: the
like-for-like reference for them. The verifier's
greedy tokens are computed once per sample (`simulate`) and shared by every drafter simulated.
On a GPU the drafters and the head run in bf16 there; on CPU in fp32 (drafter/load.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from eagle3_pipeline.core.errors import VerifierError
from eagle3_pipeline.evaluation import acceptance


@dataclass
class AcceptanceCounts:
    num_steps: int
    drafts: int = 0
    accepted_per_pos: list[int] | None = None

    def __post_init__(self) -> None:
        if self.accepted_per_pos is None:
            self.accepted_per_pos = [0] * self.num_steps

    def add(self, accepted_prefix: torch.Tensor) -> None:
        """accepted_prefix: bool [n_starts, num_steps], True while all steps so far matched."""
        self.drafts += accepted_prefix.shape[0]
        for k in range(self.num_steps):
            self.accepted_per_pos[k] += int(accepted_prefix[:, k].sum())

    def summary(self) -> dict:
        return acceptance.summary(
            self.drafts,
            self.drafts * self.num_steps,
            sum(self.accepted_per_pos),
            self.accepted_per_pos,
        )


class VerifierHead:
    """The verifier's final norm + lm_head, read straight from its safetensors files.

    Tensors are found by name suffix, as speculators' trainer finds them (`load_model_layers`),
    so both read the same ones: `model.norm.weight` / `lm_head.weight` in a causal LM,
    `language_model.model.norm.weight` / `language_model.lm_head.weight` in Kimi-K2.5's wrapper.
    """

    SUFFIXES = {"norm": "model.norm.weight", "lm_head": "lm_head.weight"}
    TIED = "embed_tokens.weight"  # lm_head of a model with tied embeddings

    def __init__(
        self,
        verifier_dir: str | Path,
        rms_norm_eps: float,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        files = sorted(Path(verifier_dir).glob("*.safetensors"))
        keys: dict[str, Path] = {}
        for f in files:
            with safe_open(str(f), framework="pt") as fh:
                keys |= dict.fromkeys(fh.keys(), f)
        found: dict[str, torch.Tensor] = {}
        for name, suffix in self.SUFFIXES.items():
            key = self._find(keys, suffix) or (
                self._find(keys, self.TIED) if name == "lm_head" else None
            )
            if key is None:
                raise VerifierError(
                    f"{verifier_dir}: no tensor named *{suffix} in its safetensors files: "
                    "is verifier.path a causal language model with safetensors weights?"
                )
            with safe_open(str(keys[key]), framework="pt") as fh:
                found[name] = fh.get_tensor(key).float()
        self.norm_weight = found["norm"].to(device)
        self.lm_head = found["lm_head"].to(device=device, dtype=dtype)
        self.eps = rms_norm_eps

    @staticmethod
    def _find(keys: dict[str, Path], suffix: str) -> str | None:
        """The key equal to `suffix`, else the shortest one ending in `.suffix`."""
        if suffix in keys:
            return suffix
        matches = sorted((k for k in keys if k.endswith("." + suffix)), key=len)
        return matches[0] if matches else None

    def greedy(self, final_hidden: torch.Tensor) -> torch.Tensor:
        """The verifier's greedy token after each position (norm in fp32, lm_head in its dtype)."""
        h = final_hidden.to(self.lm_head.device).float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps) * self.norm_weight
        return (h.to(self.lm_head.dtype) @ self.lm_head.T).argmax(-1).cpu()


def _placement(drafter) -> tuple[torch.device, torch.dtype]:
    """Where a drafter's tensors live (a stand-in without them: CPU, fp32)."""
    return (
        torch.device(getattr(drafter, "device", "cpu")),
        getattr(drafter, "dtype", torch.float32),
    )


def draft_matches(
    drafter,
    hidden_states: torch.Tensor,
    token_ids: torch.Tensor,
    greedy: torch.Tensor,
    num_steps: int,
) -> torch.Tensor:
    """bool [L - 1, num_steps] (CPU): step k of the draft started at i equals the verifier's
    greedy token at i + 2 + k (False past the end)."""
    device, dtype = _placement(drafter)
    length = token_ids.shape[0]
    aux = hidden_states[:, :-1].flatten(1).to(device=device, dtype=dtype)  # [L, n_aux * H]
    ids = token_ids.to(device)
    s = length - 1
    with torch.no_grad():
        drafts = drafter(
            hidden_states=aux[:-1].unsqueeze(0),
            input_ids=ids[1:].unsqueeze(0),
            document_ids=torch.zeros(1, s, dtype=torch.long, device=device),
            position_ids=torch.arange(1, length, device=device).unsqueeze(0),
            ttt_steps=num_steps,
        )
    d2t = drafter.d2t.cpu() if drafter.d2t is not None else None
    starts = torch.arange(s)
    ok = torch.zeros(s, num_steps, dtype=torch.bool)
    for k in range(num_steps):
        ok[:, k] = slot_verdicts(drafts[k][0].cpu(), starts, k, d2t, greedy, length)
    return ok


def slot_verdicts(
    drafts: torch.Tensor,
    rows: torch.Tensor,
    k: int,
    d2t: torch.Tensor | None,
    greedy: torch.Tensor,
    length: int,
) -> torch.Tensor:
    """bool per draft: step k of the draft made at row i (draft-vocab ids, mapped by d2t) equals
    the verifier's greedy token at position i + 2 + k over the full vocab; False past the end.
    One rule for every family's simulation (chained here, parallel in parallel_offline)."""
    target = drafts + d2t[drafts] if d2t is not None else drafts
    pos = rows + 2 + k
    valid = pos < length
    verifier = torch.full_like(pos, -1)
    verifier[valid] = greedy[pos[valid] - 1]  # greedy[p]: the verifier's token at p + 1
    return valid & (target == verifier)


def accepted_prefix(ok: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """bool [n_starts, num_steps]: the accepted prefix at every supervised draft start."""
    length = ok.shape[0] + 1
    prefix = torch.cumprod(ok.int(), dim=1).bool()
    first_pos = torch.arange(ok.shape[0]) + 2
    keep = (first_pos < length) & (loss_mask[first_pos.clamp(max=length - 1)] > 0)
    return prefix[keep]


def served_walk(
    ok: torch.Tensor, loss_mask: torch.Tensor, max_positions: int | None = None
) -> torch.Tensor:
    """bool [n_drafts, num_steps]: the drafts vLLM makes when it generates this answer itself.

    The answer is the first supervised span. Its first token comes from the prefill, never
    drafted; the first draft proposes the next one; after n accepted tokens the verifier adds
    one, so the next draft starts n + 1 positions on. vLLM drafts while the request still owes
    tokens (its first `max_positions`, vLLM's max_tokens), and a draft made then is verified and
    counted whole, past max_tokens too (the surplus is cut from the output, not from vLLM's
    counters); past the answer's end it counts as rejected. Assumes the stored answer is the
    verifier's greedy one (where it is not, the walk still follows the stored tokens).
    """
    supervised = (loss_mask > 0).nonzero().flatten()
    if len(supervised) == 0:
        return ok[:0]
    answer = int(supervised[0])
    gaps = (loss_mask[answer:] == 0).nonzero().flatten()
    end = answer + int(gaps[0]) if len(gaps) else len(loss_mask)
    owed = end if max_positions is None else min(end, answer + max_positions)
    steps = torch.arange(ok.shape[1])
    rows = []
    i = answer - 1  # draft from the prefill's hidden state: proposes position answer + 1
    while i + 2 < owed:
        row = ok[i] & (i + 2 + steps < end)
        row = torch.cumprod(row.int(), dim=0).bool()
        rows.append(row)
        i += int(row.sum()) + 1
    return torch.stack(rows) if rows else ok[:0]


def simulate_sample(
    drafter,
    head: VerifierHead,
    hidden_states: torch.Tensor,
    token_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    num_steps: int,
    greedy: torch.Tensor | None = None,
) -> torch.Tensor:
    """bool [n_starts, num_steps]: accepted prefix at every draft start of one sample.

    `greedy` (head.greedy of the final states) may be given when several drafters share it.
    """
    if greedy is None:
        greedy = head.greedy(hidden_states[:, -1])  # greedy[p] = verifier's token for p + 1
    ok = draft_matches(drafter, hidden_states, token_ids, greedy, num_steps)
    return accepted_prefix(ok, loss_mask)


@dataclass
class Simulation:
    """What `simulate` counted: every drafter on `whole` samples, the served one on `same`."""

    whole: dict[str, AcceptanceCounts]
    same: AcceptanceCounts | None
    num_whole: int
    num_same: int
    same_by_k: dict[int, AcceptanceCounts] = field(default_factory=dict)  # `sweep`'s walks


def simulate(
    models: dict[str, Any],
    head: VerifierHead,
    read: Callable[[str], dict[str, torch.Tensor]],
    whole_ids: Iterable[str],
    num_steps: int,
    same_ids: Iterable[str] = (),
    served: str = "trained",
    max_positions: int | None = None,
    on_sample: Callable[[], None] | None = None,
    matches: Callable[..., torch.Tensor] = draft_matches,
    sweep: Iterable[int] = (),
) -> Simulation:
    """Every model at every supervised start of the `whole_ids` samples, and the `served` model
    on vLLM's walk through the first `max_positions` answer tokens of the `same_ids` samples.
    `matches` drafts as the family does (EAGLE-3's chain here; DFlash's and P-EAGLE's one pass
    per draft: parallel_offline.MATCHES).

    Each sample is read once and its verifier greedy tokens computed once, whatever the number
    of models; a sample in both sets is simulated once per model. `sweep`: further draft
    counts at which the `served` model's walk is simulated again (drafting that many).
    """
    whole, same = list(whole_ids), list(same_ids)
    in_whole, in_same = set(whole), set(same)
    counts = {name: AcceptanceCounts(num_steps) for name in models}
    same_counts = AcceptanceCounts(num_steps) if same else None
    by_k = {n: AcceptanceCounts(n) for n in sweep if n != num_steps} if same else {}
    for sid in whole + [s for s in same if s not in in_whole]:
        t = read(sid)
        hs, ids, mask = t["hidden_states"], t["token_ids"], t["loss_mask"]
        greedy = head.greedy(hs[:, -1])
        for name, model in models.items():
            walk = name == served and sid in in_same
            if sid not in in_whole and not walk:
                continue
            ok = matches(model, hs, ids, greedy, num_steps)
            if sid in in_whole:
                counts[name].add(accepted_prefix(ok, mask))
            if walk and same_counts is not None:
                same_counts.add(served_walk(ok, mask, max_positions))
                for n, c in by_k.items():
                    c.add(served_walk(matches(model, hs, ids, greedy, n), mask, max_positions))
        if on_sample is not None:
            on_sample()
    return Simulation(counts, same_counts, len(whole), len(in_same), by_k)
