"""scripts/gpu_check.py: refuses a machine without CUDA in one line; the plan; the driver rule."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from scripts_loader import script_module

REPO = Path(__file__).resolve().parents[3]


gc = script_module("gpu_check")
SCRIPT = REPO / "scripts/gpu_check.py"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_refuses_without_cuda() -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu-check: no CUDA device")
    assert proc.stdout == ""


def test_driver_minimum_is_known_for_the_lock_cuda() -> None:
    lock = (REPO / "locks/cuda.txt").read_text()
    toolkit = next(x for x in lock.splitlines() if x.startswith("cuda-toolkit=="))
    cuda = ".".join(toolkit.split("==")[1].split(".")[:2])
    assert cuda in gc.MIN_DRIVER, "state the minimum driver of the lock's CUDA (and README)"
    assert gc.driver_verdict("580.65.06", "13.0")[0]
    ok, text = gc.driver_verdict("575.57.08", "13.0")
    assert not ok and text == "driver 575.57.08 < 580.65.06 (CUDA 13.0)"
    assert not gc.driver_verdict("600.1", "99.0")[0]


def test_plan_names_every_check_and_its_config(capsys) -> None:
    """`--plan` runs nothing and needs no GPU: the checks, commands and configs of a run."""
    assert gc.main(["--plan", "--gpus", "2"]) == 0
    plan = json.loads(capsys.readouterr().out)
    checks = [c["check"] for c in plan]
    assert checks == [
        "device",
        "toolchain",
        "uid",
        "bf16-matmul",
        "llama/*",
        "mla/*",
        "kimi/int4-checkpoint",
        "kimi/generate",
    ]
    by = {c["check"]: c for c in plan}
    assert by["toolchain"]["command"][0].endswith("/bin/nvcc")
    assert {"TRITON_CACHE_DIR", "FLASHINFER_WORKSPACE_BASE", "HOME"} <= set(
        by["toolchain"]["caches"]
    )
    assert by["mla/*"]["params"]["train"]["nproc"] == 2  # torchrun, DDP on both GPUs
    assert "eagle3 train --params params.yaml" in by["mla/*"]["commands"]
    kimi = by["kimi/generate"]["params"]
    assert kimi["vllm"]["tensor_parallel_size"] == 2 and kimi["vllm"]["enforce_eager"] is False
    g = kimi["generate"]
    assert (g["backend"], g["reasoning_parser"], g["top_p"]) == ("vllm", "kimi_k2", 0.95)
    assert g["chat_template_kwargs"] == {"thinking": True}
    assert by["kimi/generate"]["commands"][-1] == f"eagle3 generate --params {gc.KIMI_PARAMS}"
    q = by["kimi/int4-checkpoint"]["quantization_config"]
    assert q == json.loads((REPO / "tests/fixtures/kimi-k2.5/config.json").read_text())[
        "quantization_config"
    ] | {"config_groups": q["config_groups"]}  # Kimi-K2.5's own, group fields included
    assert q["config_groups"]["group_0"]["weights"]["group_size"] == 32
