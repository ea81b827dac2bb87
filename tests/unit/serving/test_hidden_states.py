"""serving/hidden_states.py without vLLM: the layer order vLLM returns and its inverse, and the
length check before an engine starts (engine kwargs and the real engine:
tests/integration/test_extract_vllm.py)."""

from __future__ import annotations

import pytest
from extract_llama_case import AUX_IDS, N_LAYERS

from eagle3_pipeline.core.errors import DataError
from eagle3_pipeline.serving import hidden_states as vllm_extract


def test_vllm_layer_order_is_ascending_and_inverted() -> None:
    ordered, index = vllm_extract.vllm_layer_order([*AUX_IDS, N_LAYERS])
    assert ordered == [0, 3, 5, 8]
    assert [ordered[i] for i in index] == [*AUX_IDS, N_LAYERS]


def test_too_long_sample_is_refused_before_vllm_starts() -> None:
    with pytest.raises(DataError, match="sample s1 has 300 tokens.*vllm.max_model_len"):
        vllm_extract.check_prompt_lengths({"s0": 10, "s1": 300}, 256)
