"""extract: token-budget batching, within the budget and with little padding; a killed run
redoes at most the batch in flight."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch
from extract_llama_case import AUX_IDS, make_params, write_tokenized

from eagle3_pipeline.core.errors import DataError
from eagle3_pipeline.stages import extract
from eagle3_pipeline.stages.extract import token_budget_batches
from eagle3_pipeline.store import format as store


def test_token_budget_batches() -> None:
    lengths = {f"s{i}": n for i, n in enumerate([5, 100, 7, 64, 64, 3, 99, 12, 50, 1])}
    batches = token_budget_batches(lengths, 128)
    assert sorted(s for b in batches for s in b) == sorted(lengths)
    for b in batches:
        assert len(b) * max(lengths[s] for s in b) <= 128
    with pytest.raises(DataError, match="max_tokens_per_batch"):
        token_budget_batches({"long": 200}, 128)


def test_length_sorted_batches_respect_the_budget_and_pad_little() -> None:
    """Long-tailed lengths (reasoning traces): no batch over budget, little padding."""
    from eagle3_pipeline.stages.extract import padding_fraction

    torch.manual_seed(0)
    raw = (torch.distributions.LogNormal(6.0, 0.8).sample((500,)).clamp(max=4000) + 1).int()
    lengths = {f"s{i:03d}": int(n) for i, n in enumerate(raw)}
    budget = 8192
    batches = token_budget_batches(lengths, budget)
    assert sorted(s for b in batches for s in b) == sorted(lengths)
    assert max(len(b) * max(lengths[s] for s in b) for b in batches) <= budget
    sorted_pad = padding_fraction(batches, lengths)
    # the same budget filled in arrival order, for contrast
    arrival, cur = [], []
    for sid in lengths:
        if cur and (len(cur) + 1) * max(lengths[s] for s in [*cur, sid]) > budget:
            arrival.append(cur)
            cur = []
        cur.append(sid)
    arrival.append(cur)
    assert sorted_pad < 0.05 < padding_fraction(arrival, lengths)


@pytest.fixture(scope="module")
def verifier(tiny_verifier_dir: Path) -> Path:
    """The shared tiny verifier (head_dim 32, which vLLM's CPU attention needs)."""
    return tiny_verifier_dir


def test_killed_run_redoes_at_most_one_batch(verifier, tmp_path, monkeypatch) -> None:
    """Resume is the stage's, shared by both backends: a fake backend dies on its 2nd batch."""
    monkeypatch.chdir(tmp_path)
    prompts = write_tokenized(tmp_path)
    n_batches = len(extract.token_budget_batches({s: len(p) for s, p in prompts.items()}, 100))
    calls: list[int] = []

    def fake_backend(fail_at: int | None):
        def run_batch(batch: list[list[int]]) -> list[torch.Tensor]:
            calls.append(len(batch))
            if len(calls) == fail_at:
                raise KeyboardInterrupt
            return [torch.zeros(len(ids), len(AUX_IDS) + 1, 64) for ids in batch]

        return lambda *_args, **_kwargs: contextlib.nullcontext(run_batch)

    params = make_params(verifier, "vllm")
    monkeypatch.setattr(extract, "open_backend", fake_backend(fail_at=2))
    with pytest.raises(KeyboardInterrupt):
        extract.run(params)
    monkeypatch.setattr(extract, "open_backend", fake_backend(fail_at=None))
    extract.run(params)
    assert n_batches == 3 and len(calls) == n_batches + 1  # batch 2 redone, batch 1 kept
    assert store.read_manifest(Path("data/hidden_states"))["num_samples"] == len(prompts)
