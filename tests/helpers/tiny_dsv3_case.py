"""The tiny-dsv3 verifier's case, shared by its unit tests and its vLLM test: its depth, aux ids
out of order, and the model loaded as the stages load it."""

from __future__ import annotations

from pathlib import Path

from eagle3_pipeline.config.params import Params
from eagle3_pipeline.verifier import loading
from eagle3_pipeline.verifier.identity import read_verifier

N_LAYERS = 3
AUX_IDS = [2, 1]  # out of order: vLLM returns them ascending (id 0: test_tiny_kimi.py)


def load_hf(verifier: Path):
    params = Params.model_validate({"verifier": {"source": "pretrained", "path": str(verifier)}})
    return loading.load_model(read_verifier(params.verifier))
