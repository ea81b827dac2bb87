"""Speculators' flex attention on a GPU, kept on Inductor's main Triton kernel.

Shared by training (speculators_patches.apply_shims) and by every drafter loaded on a GPU
(drafter/load.py), so both run the kernel the other was checked with.
"""

from __future__ import annotations

from typing import Any


def flex_attention_main_kernel() -> None:
    """Make speculators' flex attention use Inductor's main Triton kernel, never flex-decoding.

    For a query under 128 tokens with grouped KV heads, the AUTO backend picks flex-decoding,
    whose BLOCK_M (the next power of 2 of query length x query heads per KV head) can exceed the
    mask's 128-token blocks; then no config is left: `NoValidChoicesError` (torch 2.11 on an
    H200, `make gpu-check`: a 79-token sample, 4 query and 2 KV heads, in offline evaluation;
    torch 2.13's flex_decoding.py computes BLOCK_M the same way). Training's long batches already
    take the main kernel; BACKEND=TRITON makes every length take it.
    """
    from speculators.models import attention

    if getattr(attention.flex_attention, "main_kernel_only", False):
        return
    original = attention.flex_attention

    def flex_attention(*args: Any, **kwargs: Any) -> Any:
        return original(*args, kernel_options={"BACKEND": "TRITON"}, **kwargs)

    flex_attention.main_kernel_only = True  # type: ignore[attr-defined]
    attention.flex_attention = flex_attention
