"""The Llama case the extract tests share with the hf-vs-vLLM one: aux ids out of order and
with 0 (the embeddings), the depth of the tiny verifier, sample lengths, params, tokenized rows."""

from __future__ import annotations

from pathlib import Path

from extract_fixtures import extract_params
from extract_fixtures import write_tokenized as shared_write_tokenized

from eagle3_pipeline.config.params import Params

AUX_IDS = [5, 0, 3]
N_LAYERS = 8  # the tiny_verifier_dir fixture
LENGTHS = {"train": [7, 19, 33, 48, 61], "val": [26]}


def make_params(verifier: Path, backend: str) -> Params:
    return extract_params(verifier, backend, AUX_IDS, N_LAYERS, max_tokens_per_batch=100)


def write_tokenized(root: Path, vocab_size: int = 1024) -> dict[str, list[int]]:
    return shared_write_tokenized(root, LENGTHS, vocab_size, prompt_tokens=2)
