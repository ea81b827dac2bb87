"""The generate stage's inputs and outputs in a temp dir: prepared rows, params for the vllm
backend, and the rows it wrote."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from builders import make_params

from eagle3_pipeline.config.params import Params
from eagle3_pipeline.core import atomic, readers


def prepare_rows(root: Path, n: int) -> list[str]:
    ids = [f"q{i:02d}" for i in range(n)]
    rows = [{"id": i, "messages": [{"role": "user", "content": f"question {i}"}]} for i in ids]
    cut = n - max(1, n // 5)
    atomic.write_jsonl(root / "data/prepared/train.jsonl", rows[:cut])
    atomic.write_jsonl(root / "data/prepared/val.jsonl", rows[cut:])
    return ids


def vllm_params(verifier: Path, **generate_kw: Any) -> Params:
    """Generate's vllm backend on `verifier`, 8 new tokens, `generate_kw` changing the rest."""
    return make_params(
        seed=7,
        verifier={"path": str(verifier)},
        generate={"backend": "vllm", "max_new_tokens": 8, **generate_kw},
    )


def output_rows(root: Path) -> list[dict]:
    out = root / "data/generated"
    return readers.read_jsonl(out / "train.jsonl") + readers.read_jsonl(out / "val.jsonl")
