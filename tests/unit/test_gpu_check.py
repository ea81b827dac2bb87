"""scripts/gpu_check.py: refuses a machine without CUDA in one line; its pure helpers."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts/gpu_check.py"


def _module():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_refuses_without_cuda() -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu-check: no CUDA device")
    assert proc.stdout == ""


def test_overrides_keep_the_profile_valid_and_bf16() -> None:
    import yaml

    from eagle3_pipeline.params import Params

    gc = _module()
    base = yaml.safe_load((REPO / "profiles/tiny-llama.yaml").read_text())
    merged = gc.merge(base, gc.OVERRIDES)
    params = Params.model_validate(merged)
    assert params.vllm.extra_args == ["--dtype", "bfloat16"]
    assert params.extract.store_dtype == "bf16" and params.extract.backend == "vllm"
    assert params.verifier.tiny.num_hidden_layers == base["verifier"]["tiny"]["num_hidden_layers"]
    assert base["vllm"]["extra_args"] == ["--dtype", "float32"]  # merge copied, not mutated


def test_tokens_per_s_and_median(tmp_path: Path) -> None:
    gc = _module()
    assert gc.tokens_per_s(1000, 2.0) == 500.0
    with pytest.raises(ValueError):
        gc.tokens_per_s(10, 0.0)
    tsv = tmp_path / "tokens_per_s.tsv"
    tsv.write_text("step\ttokens_per_s\n0\t10.0\n1\t30.0\n2\t20.0\n")
    assert gc.median_step_tokens_per_s(tsv) == 20.0
    assert gc.median_step_tokens_per_s(tmp_path / "missing.tsv") is None
