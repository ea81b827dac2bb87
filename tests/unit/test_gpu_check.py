"""scripts/gpu_check.py: refuses a machine without CUDA in one line; its CPU-runnable parts."""

from __future__ import annotations

import importlib.util
import json
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


gc = _module()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_refuses_without_cuda() -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu-check: no CUDA device")
    assert proc.stdout == ""


@pytest.mark.parametrize("name", sorted(gc.PIPELINES))
def test_pipeline_params_are_valid_bf16_and_online(name: str) -> None:
    import yaml

    from eagle3_pipeline.params import Params

    profile = gc.PIPELINES[name]["profile"]
    base = yaml.safe_load((REPO / f"profiles/{profile}.yaml").read_text())
    params = Params.model_validate(gc.pipeline_params(name))
    assert params.vllm.extra_args == ["--dtype", "bfloat16"]
    assert params.extract.store_dtype == "bf16" and params.extract.backend == "vllm"
    assert params.evaluate.online  # vLLM serves the verifier with the drafter
    assert params.verifier.tiny.architecture == base["verifier"]["tiny"]["architecture"]
    assert base["vllm"]["extra_args"][:2] == ["--dtype", "float32"]  # merge copied, not mutated


def test_the_mla_verifier_is_checked() -> None:
    assert gc.pipeline_params("mla")["verifier"]["tiny"]["architecture"] == "deepseek_v3"
    assert gc.pipeline_params("llama")["verifier"]["tiny"]["architecture"] == "llama"


def test_driver_minimum_is_known_for_the_lock_cuda() -> None:
    lock = (REPO / "locks/cuda.txt").read_text()
    toolkit = next(x for x in lock.splitlines() if x.startswith("cuda-toolkit=="))
    cuda = ".".join(toolkit.split("==")[1].split(".")[:2])
    assert cuda in gc.MIN_DRIVER, "state the minimum driver of the lock's CUDA (and README)"
    assert gc.driver_verdict("580.65.06", "13.0")[0]
    ok, text = gc.driver_verdict("575.57.08", "13.0")
    assert not ok and text == "driver 575.57.08 < 580.65.06 (CUDA 13.0)"
    assert not gc.driver_verdict("600.1", "99.0")[0]


def test_report_prints_one_line_per_check_and_spends_a_budget(capsys) -> None:
    now = [0.0]
    report = gc.Report(10.0, clock=lambda: now[0])
    report.put("PASS", "device", "H200 sm_90")
    now[0] = 4.0
    assert report.left_s() == 6.0 and report.passed
    report.put("SKIP", "mla/extract", "setup failed")
    assert not report.passed
    assert capsys.readouterr().out.splitlines() == [
        "PASS device: H200 sm_90",
        "SKIP mla/extract: setup failed",
    ]


def test_run_stage_refuses_a_spent_budget(tmp_path: Path) -> None:
    with pytest.raises(gc.StageError, match="budget"):
        gc.run_stage(tmp_path, "prepare", 0.0)


def test_online_detail_reads_eval_json() -> None:
    evaluation = {
        "online": {"mean_acceptance_length": 3.5, "acceptance_rate": 0.83, "speedup": 1.9},
        "greedy_outputs_identical": True,
        "mismatch": False,
    }
    ok, detail = gc.online_detail(json.loads(json.dumps(evaluation)))
    assert ok and detail.startswith("mean acceptance length 3.500, acceptance rate 83.0%, x1.90")
    assert not gc.online_detail({"online": {}})[0]
    assert not gc.online_detail(evaluation | {"mismatch": True})[0]
    assert "lossless identical" in detail
    # no verdict in an older eval.json: exact equality decides
    assert not gc.online_detail(evaluation | {"greedy_outputs_identical": False})[0]


def test_online_detail_passes_near_ties_and_fails_divergence() -> None:
    evaluation = {
        "online": {"mean_acceptance_length": 3.5, "acceptance_rate": 0.83, "speedup": 1.9},
        "greedy_outputs_identical": False,
        "mismatch": False,
        "lossless": {"verdict": "near_ties", "num_near_ties": 2},
    }
    ok, detail = gc.online_detail(evaluation)
    assert ok and "lossless near_ties (2 near ties)" in detail
    evaluation["lossless"] = {"verdict": "diverged", "num_near_ties": 0}
    ok, detail = gc.online_detail(evaluation)
    assert not ok and "lossless diverged" in detail


def test_tokens_per_s_and_median(tmp_path: Path) -> None:
    assert gc.tokens_per_s(1000, 2.0) == 500.0
    with pytest.raises(ValueError):
        gc.tokens_per_s(10, 0.0)
    tsv = tmp_path / "tokens_per_s.tsv"
    tsv.write_text("step\ttokens_per_s\n0\t10.0\n1\t30.0\n2\t20.0\n")
    assert gc.median_step_tokens_per_s(tsv) == 20.0
    assert gc.median_step_tokens_per_s(tmp_path / "missing.tsv") is None
