"""extract: the layer-id convention against the model's own forward, token-budget batching."""

from __future__ import annotations

import pytest
import torch

from eagle3_pipeline.errors import DataError
from eagle3_pipeline.stages.extract import token_budget_batches
from eagle3_pipeline.verifier.capture import LayerCapture, forward_hidden_states


@pytest.fixture(scope="module")
def model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    m = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # a final norm weight far from 1, so pre- and post-norm differ clearly
        m.model.norm.weight.uniform_(0.2, 3.0)
    return m


def test_layer_ids_follow_vllm_convention(model) -> None:
    ids = torch.randint(0, 300, (1, 17))
    norm_input = {}
    h = model.model.norm.register_forward_pre_hook(lambda _m, a: norm_input.setdefault("x", a[0]))
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True)
    h.remove()
    capture = LayerCapture(model, [0, 2, 4, 5, 8])
    got = forward_hidden_states(model, capture, [ids[0].tolist()])[0]
    capture.remove()
    ref = out.hidden_states
    for j, lid in enumerate([0, 2, 4, 5]):  # id k < N: input of decoder layer k
        torch.testing.assert_close(got[:, j], ref[lid][0])
    # id N: last decoder layer's output BEFORE the final norm ...
    torch.testing.assert_close(got[:, 4], norm_input["x"][0])
    # ... which is not transformers' hidden_states[N] (after the norm) ...
    assert not torch.allclose(got[:, 4], ref[8][0], atol=1e-3)
    # ... and gives the model's logits once the norm and lm_head are applied.
    torch.testing.assert_close(model.lm_head(model.model.norm(got[:, 4])), out.logits[0])


def test_padding_does_not_change_hidden_states(model) -> None:
    capture = LayerCapture(model, [2, 8])
    a = torch.randint(0, 300, (9,)).tolist()
    b = torch.randint(0, 300, (23,)).tolist()
    alone = forward_hidden_states(model, capture, [a])[0]
    batched = forward_hidden_states(model, capture, [a, b])[0, : len(a)]
    capture.remove()
    torch.testing.assert_close(alone, batched, atol=1e-5, rtol=1e-4)


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
