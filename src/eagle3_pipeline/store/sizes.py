"""Bytes per token of the hidden-state store, without torch.

Kept apart from format.py so that `plan` (run by the verifier stage) reads the same numbers as
the store writer without importing it: editing the store's code must not rerun the verifier.
"""

from __future__ import annotations

STORE_DTYPES = ("bf16", "fp8")


def hidden_bytes_per_token(n_layers: int, hidden_size: int, dtype: str) -> int:
    """Hidden-state bytes per token: bf16 2 B/value; fp8 1 B/value + fp32 scale per layer."""
    if dtype == "fp8":
        return n_layers * hidden_size + n_layers * 4
    return n_layers * hidden_size * 2
