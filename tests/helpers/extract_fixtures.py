"""Inputs of the extract stage built in tests: params for a pretrained-style verifier and
seeded data/tokenized rows (shared by the Llama and DeepSeek-V3 hf-vs-vLLM tests)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from eagle3_pipeline.config.params import Params


def extract_params(
    verifier: Path, backend: str, aux: list[int], final: int, max_tokens_per_batch: int
) -> Params:
    return Params.model_validate(
        {
            "verifier": {"source": "pretrained", "path": str(verifier)},
            "layers": {"aux_layer_ids": aux, "final_layer_id": final},
            "extract": {"backend": backend, "max_tokens_per_batch": max_tokens_per_batch},
            "vllm": {"max_model_len": 256, "ready_timeout_s": 900},
        }
    )


def write_tokenized(
    root: Path, lengths: dict[str, list[int]], vocab_size: int, prompt_tokens: int
) -> dict[str, list[int]]:
    """data/tokenized/{split}.jsonl with seeded token ids, the first `prompt_tokens` of each
    row unsupervised; returns id -> input_ids."""
    gen = torch.Generator().manual_seed(0)
    out: dict[str, list[int]] = {}
    for split, split_lengths in lengths.items():
        rows = []
        for n in split_lengths:
            sid = f"{split}{n:03d}"
            ids = torch.randint(10, vocab_size, (n,), generator=gen).tolist()
            mask = [0] * prompt_tokens + [1] * (n - prompt_tokens)
            rows.append({"id": sid, "input_ids": ids, "loss_mask": mask, "split": split})
            out[sid] = ids
        path = root / "data/tokenized" / f"{split}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out
