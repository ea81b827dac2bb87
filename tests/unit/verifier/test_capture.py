"""capture: the layer-id convention against the model's own forward; padding changes nothing."""

from __future__ import annotations

import pytest
import torch

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
