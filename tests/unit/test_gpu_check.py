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

    from eagle3_pipeline.config.params import Params

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


def test_one_gpu_plans_tp1_and_one_rank() -> None:
    from eagle3_pipeline.config.params import Params

    mla = gc.pipeline_params("mla", 1)
    assert mla["train"]["nproc"] == 1
    kimi = Params.model_validate(gc.kimi_params(mla, 1))
    assert kimi.vllm.tensor_parallel_size == 1 and not kimi.vllm.enforce_eager
    assert kimi.verifier.source == "pretrained" and kimi.verifier.path == gc.KIMI_DIR
    assert Params.model_validate(gc.kimi_params(gc.pipeline_params("mla", 2), 2))


def test_served_with_reads_runner_and_backends_from_the_server_log() -> None:
    log = (
        "(Worker_TP0 pid=1) INFO Using FLASH_ATTN_MLA attention backend out of potential "
        "backends: ['FLASH_ATTN_MLA', 'FLASHMLA'].\n"
        "(Worker_TP1 pid=2) INFO Using 'HUMMING' WNA16 MoE backend.\n"
        "INFO Using TRITON Unquantized MoE backend out of potential backends: ['TRITON'].\n"
        "compilation_config={'pass_config': {'fuse_allreduce_rms': True}}\n"
    )
    got = gc.served_with(log)
    assert got == {
        "runner": "Model Runner V2",
        "attention": "FLASH_ATTN_MLA",
        "moe": "HUMMING,TRITON",
        "allreduce+rmsnorm fusion": "True",
    }
    cpu = "WARNING Model Runner V2 requires Triton; using the V1 model runner instead.\n"
    assert gc.served_with(cpu)["runner"] == "V1 (MRV2 requires Triton)"
    assert gc.served_with("")["attention"] == "not logged"


def test_tiny_int4_kimi_builds_on_cpu_as_kimi_is_laid_out(tmp_path: Path) -> None:
    """The checkpoint kimi/generate serves: Kimi's wrapper and names, routed experts packed by
    compressed-tensors' own compressor (decompressed back within INT4's step), the config read
    by transformers and by vLLM's compressed-tensors config."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from safetensors.torch import load_file
    from transformers import AutoConfig
    from verifiers import build_tiny_dsv3_verifier
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
        CompressedTensorsConfig,
    )

    tokenizer_dir = build_tiny_dsv3_verifier(tmp_path / "tok", train_steps=0)
    out = tmp_path / "kimi-int4"
    shapes = gc.build_tiny_kimi_int4(out, tokenizer_dir)
    config = AutoConfig.from_pretrained(out)
    text = config.text_config
    assert type(config).__name__ == "Kimi_K25Config" and text.model_type == "deepseek_v3"
    assert (text.hidden_size, text.moe_intermediate_size, text.qk_nope_head_dim) == (1024, 512, 128)
    assert (text.kv_lora_rank, text.qk_rope_head_dim) == (512, 64)
    name = "language_model.model.layers.1.mlp.experts.0.gate_proj"
    assert shapes[f"{name}.weight_packed"] == [512, 1024 // 8]  # 8 INT4 values per int32
    assert shapes[f"{name}.weight_scale"] == [512, 1024 // 32]  # one scale per group of 32
    assert f"{name}.weight" not in shapes
    down = "language_model.model.layers.2.mlp.experts.7.down_proj"
    assert shapes[f"{down}.weight_packed"] == [1024, 512 // 8]
    # Dense layer 0, shared experts and attention stay bf16, as Kimi's ignore list says.
    assert "language_model.model.layers.0.mlp.gate_proj.weight" in shapes
    assert "language_model.model.layers.1.mlp.shared_experts.up_proj.weight" in shapes
    assert "language_model.model.layers.1.self_attn.kv_b_proj.weight" in shapes
    tensors = load_file(out / "model.safetensors")
    assert tensors[f"{name}.weight_packed"].dtype.is_floating_point is False
    w = gc.KIMI_INT4["config_groups"]["group_0"]["weights"]
    args = QuantizationArgs(
        **{k: w[k] for k in ("num_bits", "type", "symmetric", "strategy", "group_size")}
    )
    state = {k: tensors[f"{name}.{k}"] for k in ("weight_packed", "weight_scale", "weight_shape")}
    back = PackedQuantizationCompressor.decompress(
        state, QuantizationScheme(targets=["Linear"], weights=args)
    )
    assert back["weight"].shape == (512, 1024)
    quant = json.loads((out / "config.json").read_text())["quantization_config"]
    vllm_config = CompressedTensorsConfig.from_config(quant)
    assert vllm_config.get_name() == "compressed-tensors"


def test_without_vllm_extract_is_hf_and_the_drafter_is_judged_offline() -> None:
    from eagle3_pipeline.config.params import Params

    for name in gc.PIPELINES:
        params = Params.model_validate(gc.pipeline_params(name, 1, vllm=False))
        assert params.extract.backend == "hf" and not params.evaluate.online
        assert params.extract.store_dtype == "bf16"  # the rest of the shrink stays
    assert gc.pipeline_params("llama", 1)["extract"]["backend"] == "vllm"


def test_offline_detail_passes_only_a_drafter_better_than_untrained() -> None:
    def evaluation(trained: float) -> dict:
        return {
            "offline": {
                "trained": {"mean_acceptance_length": trained, "acceptance_rate": 0.5},
                "untrained": {"mean_acceptance_length": 1.0},
            },
            "offline_run": {"device": "cuda", "dtype": "bfloat16"},
        }

    ok, detail = gc.offline_detail(evaluation(2.5))
    assert ok and detail.startswith("simulated mean acceptance length 2.500 (untrained 1.000)")
    assert "(cuda, bfloat16)" in detail
    assert not gc.offline_detail(evaluation(1.0))[0]
    assert not gc.offline_detail({})[0]


def test_run_stage_keeps_an_existing_pythonpath_after_the_copy(monkeypatch, tmp_path) -> None:
    """Wheels carried to a bare GPU box (PYTHONPATH) stay importable by every stage."""
    seen = {}

    def fake_run(cmd, cwd, env, **kwargs):
        seen.update(env=env)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(gc.subprocess, "run", fake_run)
    monkeypatch.setenv("PYTHONPATH", "/tmp/site")
    gc.run_stage(tmp_path, "prepare", 10.0)
    assert seen["env"]["PYTHONPATH"] == f"{tmp_path / 'src'}:/tmp/site"
    monkeypatch.delenv("PYTHONPATH")
    gc.run_stage(tmp_path, "prepare", 10.0)
    assert seen["env"]["PYTHONPATH"] == str(tmp_path / "src")


def test_without_vllm_every_vllm_check_is_skipped(monkeypatch, tmp_path, capsys) -> None:
    """A failed setup names the no-vLLM checks; kimi/generate is SKIP, never run."""

    def failing(ws, stage, timeout_s, params_file="params.yaml"):
        raise gc.StageError(f"{stage} exited 1")

    monkeypatch.setattr(gc, "run_stage", failing)
    monkeypatch.setattr(gc, "copy_repo", lambda dst: dst.mkdir(parents=True) or dst)
    report = gc.Report(60.0)
    assert gc.check_pipeline("llama", report, tmp_path, 1, vllm=False) is None
    monkeypatch.setattr(gc, "build_tiny_kimi_int4", lambda out, tok: {"a.weight_packed": [1, 1]})
    gc.check_kimi(report, tmp_path, 1, vllm=False)
    assert [x.split(":")[0] for x in report.lines] == [
        "FAIL llama/setup",
        "SKIP llama/extract-hf",
        "SKIP llama/train-bf16",
        "SKIP llama/acceptance-offline",
        "PASS kimi/int4-checkpoint",
        "SKIP kimi/generate",
    ]
    assert report.lines[-1] == f"SKIP kimi/generate: {gc.NO_VLLM}"


def test_a_failed_stage_names_its_error_line(monkeypatch, tmp_path) -> None:
    """The `error:` line, not the hint or the compiler's context printed after it."""
    out = (
        "[train] epoch 1\nerror: train failed: AssertionError: ListVariable(length=21) is "
        "already tracked\n\nfrom user code:\n  File x.py\n (rerun with --debug for the traceback)\n"
    )
    monkeypatch.setattr(
        gc.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1, "", out)
    )
    with pytest.raises(gc.StageError) as e:
        gc.run_stage(tmp_path, "train", 10.0)
    assert str(e.value) == (
        "train exited 1: error: train failed: AssertionError: ListVariable(length=21) is "
        "already tracked"
    )
    assert (tmp_path / "train.log").read_text() == out
    plain = "just a last line\n"
    monkeypatch.setattr(
        gc.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(cmd, 2, plain, "")
    )
    with pytest.raises(gc.StageError, match="exited 2: just a last line$"):
        gc.run_stage(tmp_path, "train", 10.0)
