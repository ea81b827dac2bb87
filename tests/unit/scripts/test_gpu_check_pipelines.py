"""scripts/gpu_check_pipelines.py: the pipelines' params, the lines eval.json gives, and what runs
without vLLM."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from scripts_loader import script_module

REPO = Path(__file__).resolve().parents[3]


gp = script_module("gpu_check_pipelines")


@pytest.mark.parametrize("name", sorted(gp.PIPELINES))
def test_pipeline_params_are_valid_bf16_and_online(name: str) -> None:
    import yaml

    from eagle3_pipeline.config.params import Params

    profile = gp.PIPELINES[name]["profile"]
    base = yaml.safe_load((REPO / f"profiles/{profile}.yaml").read_text())
    params = Params.model_validate(gp.pipeline_params(name))
    assert params.vllm.extra_args == ["--dtype", "bfloat16"]
    assert params.extract.store_dtype == "bf16" and params.extract.backend == "vllm"
    assert params.evaluate.online  # vLLM serves the verifier with the drafter
    assert params.verifier.tiny.architecture == base["verifier"]["tiny"]["architecture"]
    assert base["vllm"]["extra_args"][:2] == ["--dtype", "float32"]  # merge copied, not mutated


def test_the_mla_verifier_is_checked() -> None:
    assert gp.pipeline_params("mla")["verifier"]["tiny"]["architecture"] == "deepseek_v3"
    assert gp.pipeline_params("llama")["verifier"]["tiny"]["architecture"] == "llama"


def test_online_detail_reads_eval_json() -> None:
    evaluation = {
        "online": {"mean_acceptance_length": 3.5, "acceptance_rate": 0.83, "speedup": 1.9},
        "greedy_outputs_identical": True,
        "mismatch": False,
    }
    ok, detail = gp.online_detail(json.loads(json.dumps(evaluation)))
    assert ok and detail.startswith("mean acceptance length 3.500, acceptance rate 83.0%, x1.90")
    assert not gp.online_detail({"online": {}})[0]
    assert not gp.online_detail(evaluation | {"mismatch": True})[0]
    assert "lossless identical" in detail
    # no verdict in an older eval.json: exact equality decides
    assert not gp.online_detail(evaluation | {"greedy_outputs_identical": False})[0]


def test_online_detail_passes_near_ties_and_fails_divergence() -> None:
    evaluation = {
        "online": {"mean_acceptance_length": 3.5, "acceptance_rate": 0.83, "speedup": 1.9},
        "greedy_outputs_identical": False,
        "mismatch": False,
        "lossless": {"verdict": "near_ties", "num_near_ties": 2},
    }
    ok, detail = gp.online_detail(evaluation)
    assert ok and "lossless near_ties (2 near ties)" in detail
    evaluation["lossless"] = {"verdict": "diverged", "num_near_ties": 0}
    ok, detail = gp.online_detail(evaluation)
    assert not ok and "lossless diverged" in detail


def test_one_gpu_plans_tp1_and_one_rank() -> None:
    from eagle3_pipeline.config.params import Params

    mla = gp.pipeline_params("mla", 1)
    assert mla["train"]["nproc"] == 1
    kimi = Params.model_validate(gp.kimi_params(mla, 1))
    assert kimi.vllm.tensor_parallel_size == 1 and not kimi.vllm.enforce_eager
    assert kimi.verifier.source == "pretrained" and kimi.verifier.path == gp.KIMI_DIR
    assert Params.model_validate(gp.kimi_params(gp.pipeline_params("mla", 2), 2))


def test_without_vllm_extract_is_hf_and_the_drafter_is_judged_offline() -> None:
    from eagle3_pipeline.config.params import Params

    for name in gp.PIPELINES:
        params = Params.model_validate(gp.pipeline_params(name, 1, vllm=False))
        assert params.extract.backend == "hf" and not params.evaluate.online
        assert params.extract.store_dtype == "bf16"  # the rest of the shrink stays
    assert gp.pipeline_params("llama", 1)["extract"]["backend"] == "vllm"


def test_offline_detail_passes_only_a_drafter_better_than_untrained() -> None:
    def evaluation(trained: float) -> dict:
        return {
            "offline": {
                "trained": {"mean_acceptance_length": trained, "acceptance_rate": 0.5},
                "untrained": {"mean_acceptance_length": 1.0},
            },
            "offline_run": {"device": "cuda", "dtype": "bfloat16"},
        }

    ok, detail = gp.offline_detail(evaluation(2.5))
    assert ok and detail.startswith("simulated mean acceptance length 2.500 (untrained 1.000)")
    assert "(cuda, bfloat16)" in detail
    assert not gp.offline_detail(evaluation(1.0))[0]
    assert not gp.offline_detail({})[0]


def test_without_vllm_every_vllm_check_is_skipped(monkeypatch, tmp_path, capsys) -> None:
    """A failed setup names the no-vLLM checks; kimi/generate is SKIP, never run."""

    def failing(ws, stage, timeout_s, params_file="params.yaml"):
        raise gp.StageError(f"{stage} exited 1")

    monkeypatch.setattr(gp, "run_stage", failing)
    monkeypatch.setattr(gp, "copy_repo", lambda dst: dst.mkdir(parents=True) or dst)
    report = gp.Report(60.0)
    assert gp.check_pipeline("llama", report, tmp_path, 1, vllm=False) is None
    monkeypatch.setattr(gp, "build_tiny_kimi_int4", lambda out, tok: {"a.weight_packed": [1, 1]})
    gp.check_kimi(report, tmp_path, 1, vllm=False)
    assert [x.split(":")[0] for x in report.lines] == [
        "FAIL llama/setup",
        "SKIP llama/extract-hf",
        "SKIP llama/train-bf16",
        "SKIP llama/acceptance-offline",
        "PASS kimi/int4-checkpoint",
        "SKIP kimi/generate",
    ]
    assert report.lines[-1] == f"SKIP kimi/generate: {gp.NO_VLLM}"
