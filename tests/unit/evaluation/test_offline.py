"""evaluation/offline.py: the verifier head read from safetensors, the chained draft acceptance
at every draft start (as vLLM drafts), and the counts over samples."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from eagle3_pipeline.core.errors import VerifierError
from eagle3_pipeline.evaluation import offline

V = 5  # vocab = hidden size: lm_head is the identity, so greedy = argmax of the hidden state


def _head_dir(root: Path, tensors: dict[str, torch.Tensor]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(root / "model.safetensors"))
    return root


def _head(tmp_path: Path) -> offline.VerifierHead:
    tensors = {"model.norm.weight": torch.ones(V), "lm_head.weight": torch.eye(V)}
    return offline.VerifierHead(_head_dir(tmp_path / "v", tensors), rms_norm_eps=1e-6)


# --- VerifierHead ----------------------------------------------------------------------------


def test_head_is_norm_then_lm_head(tmp_path: Path) -> None:
    torch.manual_seed(0)
    norm, lm_head = torch.rand(8) + 0.5, torch.randn(11, 8)
    path = _head_dir(tmp_path / "v", {"model.norm.weight": norm, "lm_head.weight": lm_head})
    head = offline.VerifierHead(path, rms_norm_eps=1e-5)
    h = torch.randn(6, 8)
    ref = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5) * norm) @ lm_head.T
    assert torch.equal(head.greedy(h), ref.argmax(-1))


def test_head_found_by_suffix_in_a_wrapper_and_tied(tmp_path: Path) -> None:
    wrapped = {
        "language_model.model.norm.weight": torch.ones(V),
        "language_model.lm_head.weight": torch.eye(V),
        "vision_tower.blocks.0.model.norm.weight": torch.zeros(V),  # longer: not chosen
    }
    head = offline.VerifierHead(_head_dir(tmp_path / "w", wrapped), 1e-6)
    assert torch.equal(head.norm_weight, torch.ones(V)) and torch.equal(head.lm_head, torch.eye(V))
    tied = {"model.norm.weight": torch.ones(V), "model.embed_tokens.weight": 2 * torch.eye(V)}
    assert torch.equal(
        offline.VerifierHead(_head_dir(tmp_path / "t", tied), 1e-6).lm_head,
        tied["model.embed_tokens.weight"],
    )


def test_head_without_lm_head_is_a_verifier_error(tmp_path: Path) -> None:
    path = _head_dir(tmp_path / "v", {"model.norm.weight": torch.ones(V)})
    with pytest.raises(VerifierError, match=r"no tensor named \*lm_head.weight"):
        offline.VerifierHead(path, 1e-6)


# --- simulate_sample -------------------------------------------------------------------------

GREEDY = [1, 2, 3, 4, 1, 2]  # the verifier's token for position p + 1, p = 0..5
TOKENS = torch.tensor([0, 1, 2, 3, 4, 1])  # L = 6
N_AUX, K = 2, 3


class ScriptedDrafter:
    """Proposes step 0 right at every start, step 1 right at start 0 only, step 2 never."""

    def __init__(self, d2t: torch.Tensor | None) -> None:
        self.d2t = d2t
        self.calls: list[dict] = []

    def __call__(self, **kw: torch.Tensor) -> list[torch.Tensor]:
        self.calls.append(kw)
        s = kw["input_ids"].shape[1]
        shift = 1 if self.d2t is not None else 0  # draft id + d2t = target id
        drafts = []
        for k in range(kw["ttt_steps"]):
            right = [GREEDY[min(i + 1 + k, len(GREEDY) - 1)] for i in range(s)]
            if k == 1:
                right = [right[0]] + [0] * (s - 1)
            if k == 2:
                right = [0] * s
            drafts.append(torch.tensor([right]) - shift)
        return drafts


def _hidden_states() -> torch.Tensor:
    """[L, N_AUX + 1, V]: aux rows are the position index, the final row is one-hot greedy."""
    hs = torch.arange(len(TOKENS), dtype=torch.float).view(-1, 1, 1).repeat(1, N_AUX + 1, V)
    hs[:, -1] = torch.nn.functional.one_hot(torch.tensor(GREEDY), V).float()
    return hs


@pytest.mark.parametrize("d2t", [None, torch.ones(V, dtype=torch.long)])
def test_simulate_sample_chains_steps_like_vllm(tmp_path: Path, d2t: torch.Tensor | None) -> None:
    drafter = ScriptedDrafter(d2t)
    mask = torch.tensor([0, 0, 1, 1, 1, 1])  # supervised from position 2: starts 0..3
    got = offline.simulate_sample(drafter, _head(tmp_path), _hidden_states(), TOKENS, mask, K)
    assert got.tolist() == [
        [True, True, False],  # start 0: step 2 wrong
        [True, False, False],
        [True, False, False],
        [True, False, False],  # start 3: step 1 would be past the end
    ]
    kw = drafter.calls[0]
    assert kw["hidden_states"].shape == (1, len(TOKENS) - 1, N_AUX * V)
    assert kw["hidden_states"][0, :, 0].tolist() == [0, 1, 2, 3, 4]  # aux of positions 0..L-2
    assert kw["input_ids"][0].tolist() == TOKENS[1:].tolist()
    assert kw["position_ids"][0].tolist() == [1, 2, 3, 4, 5]
    assert kw["ttt_steps"] == K


def test_unsupervised_draft_starts_are_skipped(tmp_path: Path) -> None:
    mask = torch.tensor([0, 0, 0, 0, 1, 1])  # starts 2 and 3 only
    got = offline.simulate_sample(
        ScriptedDrafter(None), _head(tmp_path), _hidden_states(), TOKENS, mask, K
    )
    assert got.tolist() == [[True, False, False], [True, False, False]]


# --- AcceptanceCounts ------------------------------------------------------------------------


def test_counts_over_samples() -> None:
    counts = offline.AcceptanceCounts(K)
    counts.add(torch.tensor([[True, True, False], [True, False, False]]))
    counts.add(torch.tensor([[False, False, False], [True, True, True]]))
    assert counts.drafts == 4 and counts.accepted_per_pos == [3, 2, 1]
    assert counts.summary() == {
        "num_drafts": 4,
        "num_draft_tokens": 12,
        "num_accepted_tokens": 6,
        "acceptance_rate": 0.5,
        "mean_acceptance_length": 2.5,
        "acceptance_per_position": [0.75, 0.5, 0.25],
    }


def test_counts_without_drafts_are_neutral() -> None:
    got = offline.AcceptanceCounts(K).summary()
    assert got["mean_acceptance_length"] == 1.0 and got["acceptance_rate"] == 0.0
    assert got["acceptance_per_position"] == [0.0] * K and got["num_draft_tokens"] == 0


# --- served_walk: the drafts vLLM makes on the same answer -----------------------------------


def test_served_walk_jumps_past_accepted_tokens() -> None:
    mask = torch.tensor([0, 0, 1, 1, 1, 1, 1, 1])  # answer from position 2, L = 8
    ok = torch.ones(7, 2, dtype=torch.bool)
    # prefill gives position 2; drafts from start 1 (positions 3, 4), then start 4 (6, 7)
    assert offline.served_walk(ok, mask).tolist() == [[True, True], [True, True]]
    # max_tokens 4: positions 2..5; the second draft would start past them
    assert offline.served_walk(ok, mask, max_positions=4).tolist() == [[True, True]]
    # max_tokens 2: positions 2..3; the first draft is still verified whole (position 4 too),
    # as vLLM counts it, though its output stops at position 3
    assert offline.served_walk(ok, mask, max_positions=2).tolist() == [[True, True]]
    # max_tokens 1: the prefill's token is all it owes: no draft
    assert offline.served_walk(ok, mask, max_positions=1).shape == (0, 2)
    # past the answer's end a draft counts as rejected: start 4 proposes 6, 7; 7 is past it
    short = torch.tensor([0, 0, 1, 1, 1, 1, 1, 0])
    assert offline.served_walk(ok, short).tolist() == [[True, True], [True, False]]
    # nothing accepted: one draft per position, starts 1..5
    assert offline.served_walk(~ok, mask).tolist() == [[False, False]] * 5


def test_served_walk_stops_at_the_first_answer_and_without_one() -> None:
    ok = torch.ones(7, 1, dtype=torch.bool)
    mask = torch.tensor([0, 0, 1, 1, 0, 0, 1, 1])  # a second turn from 6 is not generated
    assert offline.served_walk(ok, mask).tolist() == [[True]]  # start 1 proposes 3; 4 is cut
    assert offline.served_walk(ok, torch.zeros(8, dtype=torch.long)).shape == (0, 1)


# --- simulate: samples read once, greedy once, cap, served walk ------------------------------


class CountingHead:
    def __init__(self, head: offline.VerifierHead) -> None:
        self.head, self.calls = head, 0

    def greedy(self, final: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.head.greedy(final)


def test_simulate_computes_greedy_once_per_sample_for_all_drafters(tmp_path: Path) -> None:
    head = CountingHead(_head(tmp_path))
    mask = torch.tensor([0, 0, 1, 1, 1, 1])
    samples = {
        f"s{i}": {"hidden_states": _hidden_states(), "token_ids": TOKENS, "loss_mask": mask}
        for i in range(4)
    }
    reads: list[str] = []

    def read(sid: str) -> dict:
        reads.append(sid)
        return samples[sid]

    models = {
        "trained": ScriptedDrafter(None),
        "untrained": ScriptedDrafter(None),
        "init": ScriptedDrafter(None),
    }
    sim = offline.simulate(
        models, head, read, ["s0", "s1"], K, same_ids=["s1", "s3"], max_positions=3
    )
    assert sorted(reads) == ["s0", "s1", "s3"] and head.calls == 3  # s2: beyond the cap
    assert (sim.num_whole, sim.num_same) == (2, 2)
    one = offline.simulate_sample(
        ScriptedDrafter(None), head.head, _hidden_states(), TOKENS, mask, K
    )
    for name in models:
        assert sim.whole[name].drafts == 2 * len(one)
    assert len(models["trained"].calls) == 3 and len(models["init"].calls) == 2
    assert sim.same is not None and sim.same.drafts > 0


def test_a_sweep_walks_the_served_drafter_at_each_further_count(tmp_path: Path) -> None:
    """Each count of the sweep: the served drafter's walk simulated as if vLLM drafted that many,
    the same counts as a simulation at that count alone."""
    head = _head(tmp_path)
    mask = torch.tensor([0, 0, 1, 1, 1, 1])
    sample = {"hidden_states": _hidden_states(), "token_ids": TOKENS, "loss_mask": mask}
    models = {"trained": ScriptedDrafter(None), "untrained": ScriptedDrafter(None)}
    sim = offline.simulate(
        models, head, lambda sid: sample, ["s0"], K, same_ids=["s0"], sweep=[1, K, 2]
    )
    assert sorted(sim.same_by_k) == [1, 2]  # the common count is `same` itself
    for n in (1, 2):
        alone = offline.simulate(
            {"trained": ScriptedDrafter(None)}, head, lambda sid: sample, [], n, same_ids=["s0"]
        )
        assert alone.same is not None
        assert sim.same_by_k[n].summary() == alone.same.summary()
    assert offline.simulate(models, head, lambda sid: sample, ["s0"], K, sweep=[1]).same_by_k == {}


# --- the same numbers as before: fp32 on CPU, a real speculators drafter ---------------------


def _old_simulate_sample(drafter, head, hidden_states, token_ids, loss_mask, num_steps):
    """evaluation/offline.simulate_sample before the shared-greedy / device change, verbatim."""
    length = token_ids.shape[0]
    aux = hidden_states[:, :-1].flatten(1).float()
    greedy = head.greedy(hidden_states[:, -1])
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
        target_pos = starts + 2 + k
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


def test_simulation_numbers_unchanged_on_cpu_fp32(tmp_path: Path) -> None:
    from drafter_fixtures import HIDDEN, build_drafter, build_llama_verifier

    verifier = build_llama_verifier(tmp_path / "verifier")
    drafters = {
        name: build_drafter(verifier, list(range(0, 512, 2)), [2, 4, 5], seed=seed).eval()
        for name, seed in (("trained", 0), ("untrained", 1))
    }
    head = offline.VerifierHead(verifier, 1e-6)
    gen = torch.Generator().manual_seed(0)
    samples = {}
    for i in range(3):
        n = 20 + 5 * i
        ids = torch.randint(0, 512, (n,), generator=gen)
        hs = torch.randn(n, 4, HIDDEN, generator=gen).to(torch.bfloat16)  # as the store reads
        mask = torch.zeros(n, dtype=torch.long)
        mask[6:] = 1
        samples[f"s{i}"] = {"hidden_states": hs, "token_ids": ids, "loss_mask": mask}
    sim = offline.simulate(drafters, head, samples.__getitem__, list(samples), K)
    for name, model in drafters.items():
        before = offline.AcceptanceCounts(K)
        for t in samples.values():
            old = _old_simulate_sample(
                model, head, t["hidden_states"], t["token_ids"], t["loss_mask"], K
            )
            new = offline.simulate_sample(
                model, head, t["hidden_states"], t["token_ids"], t["loss_mask"], K
            )
            assert torch.equal(old, new)
            before.add(old)
        assert sim.whole[name].summary() == before.summary()
