"""drafter/flex_kernel.py: speculators' flex attention always asks for the main Triton kernel."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from speculators.models import attention
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from eagle3_pipeline.drafter.flex_kernel import flex_attention_main_kernel


def test_every_call_asks_for_the_main_kernel_and_is_wrapped_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[Any] = []

    def recorder(query: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        seen.append(kwargs.get("kernel_options"))
        return torch.zeros_like(query)

    monkeypatch.setattr(attention, "flex_attention", recorder)
    flex_attention_main_kernel()
    flex_attention_main_kernel()  # a second load does not wrap the wrapper
    q, kv = torch.zeros(1, 4, 79, 32), torch.zeros(1, 2, 79, 32)  # the shape that failed
    out, _ = attention.flex_attention_forward(None, q, kv, kv, attention_mask=None)
    assert seen == [{"BACKEND": "TRITON"}]
    assert out.shape == (1, 79, 4, 32)


def test_the_wrapped_attention_compiles_in_one_graph_with_the_same_numbers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Dynamo traces the wrapper (fullgraph, as speculators compiles its forward); on CPU the
    main-kernel option gives AUTO's numbers: a 79-token causal query, 4 query and 2 KV heads."""
    monkeypatch.setattr(attention, "flex_attention", flex_attention)
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 79, 32), torch.randn(1, 2, 79, 32), torch.randn(1, 2, 79, 32)
    mask = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, 79, 79, device="cpu")
    auto, _ = attention.flex_attention_forward(None, q, k, v, attention_mask=mask)
    flex_attention_main_kernel()
    assert attention.flex_attention is not flex_attention
    eager, _ = attention.flex_attention_forward(None, q, k, v, attention_mask=mask)
    compiled = torch.compile(attention.flex_attention_forward, fullgraph=True)
    out, _ = compiled(None, q, k, v, attention_mask=mask)
    assert torch.equal(eager, auto)
    torch.testing.assert_close(out, auto, rtol=1e-5, atol=1e-5)
