"""Offline simulated acceptance: the drafter chained on stored hidden states, as vLLM drafts.

At every draft start i (the last verified position), step k proposes the token at position
i + 2 + k. It is accepted when it equals the verifier's greedy token there (argmax over the FULL
target vocab of the verifier's lm_head on the stored final, pre-norm hidden state) and every
earlier step was accepted. The drafter's hidden state is chained through its TTT steps and the
token fed at step k is the sequence's token; for the verifier's own greedy answers that token is
the verifier's greedy token, i.e. exactly what vLLM feeds after k accepted drafts.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from eagle3_pipeline.errors import VerifierError
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

    def __init__(self, verifier_dir: str | Path, rms_norm_eps: float) -> None:
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
        self.norm_weight = found["norm"]
        self.lm_head = found["lm_head"]
        self.eps = rms_norm_eps

    @staticmethod
    def _find(keys: dict[str, Path], suffix: str) -> str | None:
        """The key equal to `suffix`, else the shortest one ending in `.suffix`."""
        if suffix in keys:
            return suffix
        matches = sorted((k for k in keys if k.endswith("." + suffix)), key=len)
        return matches[0] if matches else None

    def greedy(self, final_hidden: torch.Tensor) -> torch.Tensor:
        h = final_hidden.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps) * self.norm_weight
        return (h @ self.lm_head.T).argmax(-1)


def simulate_sample(
    drafter,
    head: VerifierHead,
    hidden_states: torch.Tensor,
    token_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    num_steps: int,
) -> torch.Tensor:
    """bool [n_starts, num_steps]: accepted prefix at every draft start of one sample."""
    length = token_ids.shape[0]
    aux = hidden_states[:, :-1].flatten(1).float()  # [L, n_aux * H]
    final = hidden_states[:, -1]
    greedy = head.greedy(final)  # greedy[p] = verifier's token for position p + 1
    s = length - 1
    with torch.no_grad():
        drafts = drafter(
            hidden_states=aux[:-1].unsqueeze(0),
            input_ids=token_ids[1:].unsqueeze(0),
            document_ids=torch.zeros(1, s, dtype=torch.long),
            position_ids=torch.arange(1, length).unsqueeze(0),
            ttt_steps=num_steps,
        )
    d2t = drafter.d2t
    starts = torch.arange(s)
    ok = torch.zeros(s, num_steps, dtype=torch.bool)
    for k in range(num_steps):
        target_pos = starts + 2 + k  # position whose token step k proposes
        valid = target_pos < length
        draft_ids = drafts[k][0]
        target_ids = draft_ids + d2t[draft_ids] if d2t is not None else draft_ids
        verifier_tok = torch.full((s,), -1, dtype=torch.long)
        verifier_tok[valid] = greedy[target_pos[valid] - 1]
        ok[:, k] = valid & (target_ids == verifier_tok)
    prefix = torch.cumprod(ok.int(), dim=1).bool()
    first_pos = starts + 2
    keep = (first_pos < length) & (loss_mask[first_pos.clamp(max=length - 1)] > 0)
    return prefix[keep]
