"""The pipeline checks of `make gpu-check` (scripts/gpu_check.py): the tiny profiles shrunk and in
bf16 through the pipeline's own CLI, each in a temp copy of the repo (llama/*, mla/*), and the tiny
INT4 Kimi-K2.5 served by the generate stage as the kimi-k2.5 profile serves Kimi (kimi/*).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_check_harness import (  # noqa: E402
    NO_VLLM,
    REPO,
    Report,
    StageError,
    copy_repo,
    median_step_tokens_per_s,
    merge,
    run_stage,
    tokens_per_s,
    train_tokens,
)
from gpu_check_kimi_int4 import build_tiny_kimi_int4  # noqa: E402

from eagle3_pipeline.evaluation import speedup  # noqa: E402
from eagle3_pipeline.serving.served_with import served_with  # noqa: E402

# The tiny profiles made small and fast, bf16 wherever the GPU computes; every stage runs, and
# evaluate serves the verifier with and without the drafter (online).
SHRINK: dict[str, Any] = {
    "prepare": {"max_prompts": 96},
    "vllm": {"extra_args": ["--dtype", "bfloat16"], "enforce_eager": True},
    "generate": {"backend": "hf", "max_new_tokens": 96},
    "extract": {"backend": "vllm", "store_dtype": "bf16"},
    "train": {"epochs": 3, "max_tokens_per_batch": 2048},
    "evaluate": {"online": True, "max_eval_prompts": 12},
}
PIPELINES: dict[str, dict[str, Any]] = {
    "llama": {"profile": "tiny-llama", "over": {"verifier": {"tiny": {"train_steps": 60}}}},
    "mla": {"profile": "tiny-dsv3", "over": {"verifier": {"tiny": {"train_steps": 60}}}},
}
SETUP_STAGES = ("verifier", "prepare", "generate", "tokenize")


# Without vLLM: hidden states from the HF backend, and the drafter judged offline.
WITHOUT_VLLM: dict[str, Any] = {"extract": {"backend": "hf"}, "evaluate": {"online": False}}
def pipeline_params(name: str, gpus: int = 1, vllm: bool = True) -> dict[str, Any]:
    """The pipeline's params; with two GPUs the MLA pipeline trains on both (torchrun, DDP)."""
    spec = PIPELINES[name]
    base = yaml.safe_load((REPO / "profiles" / f"{spec['profile']}.yaml").read_text())
    params = merge(merge(base, SHRINK), spec["over"])
    if name == "mla":
        params = merge(params, {"train": {"nproc": min(2, gpus), "strategy": "ddp"}})
    return params if vllm else merge(params, WITHOUT_VLLM)


def online_detail(evaluation: dict[str, Any]) -> tuple[bool, str]:
    """PASS/FAIL and numbers of the served run from metrics/eval.json."""
    online = evaluation.get("online") or {}
    if "mean_acceptance_length" not in online:
        return False, "metrics/eval.json has no online section"
    identical = bool(evaluation.get("greedy_outputs_identical"))
    mismatch = bool(evaluation.get("mismatch"))
    # The losslessness verdict (evaluation/losslessness.py): identical, near_ties (passes) or
    # diverged; an eval.json from before the verdict existed is judged by exact equality.
    lossless = evaluation.get("lossless") or {}
    verdict = lossless.get("verdict", "identical" if identical else "diverged")
    near = f" ({lossless.get('num_near_ties', 0)} near ties)" if verdict == "near_ties" else ""
    detail = (
        f"mean acceptance length {online['mean_acceptance_length']:.3f}, acceptance rate "
        f"{online.get('acceptance_rate', float('nan')):.1%}, {speedup.cell(online)} "
        f"tokens/s, greedy identical {identical}, lossless {verdict}{near}, MISMATCH {mismatch}"
    )
    return (not mismatch and verdict != "diverged"), detail


def offline_detail(evaluation: dict[str, Any]) -> tuple[bool, str]:
    """PASS/FAIL and numbers of the offline acceptance (trained drafter vs untrained)."""
    offline = evaluation.get("offline") or {}
    trained, untrained = offline.get("trained") or {}, offline.get("untrained") or {}
    if "mean_acceptance_length" not in trained:
        return False, "metrics/eval.json has no offline.trained section"
    run = evaluation.get("offline_run") or {}
    length = trained["mean_acceptance_length"]
    detail = (
        f"simulated mean acceptance length {length:.3f} (untrained "
        f"{untrained.get('mean_acceptance_length', float('nan')):.3f}), acceptance rate "
        f"{trained.get('acceptance_rate', float('nan')):.1%} over {trained.get('num_drafts')} "
        f"drafts ({run.get('device')}, {run.get('dtype')})"
    )
    return length > untrained.get("mean_acceptance_length", 1.0), detail


def check_pipeline(
    name: str, report: Report, tmp: Path, gpus: int = 1, vllm: bool = True
) -> Path | None:
    """One tiny pipeline: extract (stock connector), train (bf16), serve verifier + drafter.
    Without vLLM: extract with the HF backend and judge the drafter offline.
    Returns its workspace once setup passed (the kimi checks reuse its tokenizer and prompts)."""
    params = pipeline_params(name, gpus, vllm)
    ws = copy_repo(tmp / name)
    (ws / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    extract = "extract" if vllm else "extract-hf"
    judge = "serve-eagle3" if vllm else "acceptance-offline"
    try:
        for stage in SETUP_STAGES:
            run_stage(ws, stage, report.left_s())
    except StageError as e:
        report.put("FAIL", f"{name}/setup", str(e))
        for check in (extract, "train-bf16", judge):
            report.put("SKIP", f"{name}/{check}", "setup failed")
        return None
    if not vllm:
        report.put("SKIP", f"{name}/extract", f"{NO_VLLM} (stock connector)")
    try:
        extract_s = run_stage(ws, "extract", report.left_s())
        manifest = json.loads((ws / "data/hidden_states/manifest.json").read_text())
        n = int(manifest["num_tokens"])
        how = "stock ExampleHiddenStatesConnector" if vllm else "HF backend (CPU)"
        report.put(
            "PASS",
            f"{name}/{extract}",
            f"{how}, {n} tokens in {extract_s:.1f} s = "
            f"{tokens_per_s(n, extract_s):,.0f} tokens/s (engine start incl.)",
        )
    except (StageError, OSError, KeyError, ValueError) as e:
        report.put("FAIL", f"{name}/{extract}", str(e))
        report.put("SKIP", f"{name}/train-bf16", "no hidden states")
        report.put("SKIP", f"{name}/{judge}", "no hidden states")
        return ws
    try:
        run_stage(ws, "vocab", report.left_s())
        train_s = run_stage(ws, "train", report.left_s())
        trained = train_tokens(ws, params["train"]["epochs"])
        step = median_step_tokens_per_s(ws / "metrics/train/plots/metrics/train/tokens_per_s.tsv")
        steps = f"; median step {step:,.0f} tokens/s" if step else ""
        nproc = params["train"].get("nproc", 1)
        report.put(
            "PASS",
            f"{name}/train-bf16",
            f"nproc {nproc}: {trained} tokens in {train_s:.1f} s = "
            f"{tokens_per_s(trained, train_s):,.0f} tokens/s{steps}",
        )
    except (StageError, OSError, ValueError) as e:
        report.put("FAIL", f"{name}/train-bf16", str(e))
        report.put("SKIP", f"{name}/{judge}", "no drafter")
        return ws
    try:
        run_stage(ws, "export", report.left_s())
        eval_s = run_stage(ws, "evaluate", report.left_s())
        evaluation = json.loads((ws / "metrics/eval.json").read_text())
        ok, detail = (online_detail if vllm else offline_detail)(evaluation)
        report.put("PASS" if ok else "FAIL", f"{name}/{judge}", f"{detail}; {eval_s:.0f} s")
    except (StageError, OSError, ValueError) as e:
        report.put("FAIL", f"{name}/{judge}", str(e))
    if not vllm:
        report.put("SKIP", f"{name}/serve-eagle3", NO_VLLM)
    return ws


KIMI_DIR = "models/kimi-int4"
KIMI_PARAMS = "params-kimi.yaml"


def kimi_params(tokenizer_workspace: dict[str, Any], gpus: int) -> dict[str, Any]:
    """The generate stage on the tiny INT4 Kimi, served as the kimi-k2.5 profile serves Kimi:
    TP, compile + CUDA graphs, kimi_k2 reasoning parser, thinking on, temperature 1, top-p."""
    kimi = yaml.safe_load((REPO / "profiles/kimi-k2.5.yaml").read_text())
    g = kimi["generate"]
    return merge(
        tokenizer_workspace,
        {
            "verifier": {
                "source": "pretrained",
                "path": KIMI_DIR,
                "name": "tiny-kimi-k2.5-int4",
                "trust_remote_code": False,
            },
            "vllm": {
                "tensor_parallel_size": min(2, gpus),
                "enforce_eager": kimi["vllm"]["enforce_eager"],
                "max_model_len": 1024,
                "ready_timeout_s": 420,
                "extra_args": ["--dtype", "bfloat16", "--gpu-memory-utilization", "0.6"],
            },
            "generate": {
                "backend": "vllm",
                "max_new_tokens": 64,
                "concurrency": 16,
                **{k: g[k] for k in ("temperature", "top_p", "reasoning_parser")},
                "chat_template_kwargs": g["chat_template_kwargs"],
            },
        },
    )


def check_kimi(report: Report, mla_ws: Path | None, gpus: int, vllm: bool = True) -> None:
    """The tiny INT4 Kimi (tokenizer and prompts from the MLA pipeline's workspace), served by
    the generate stage as the kimi-k2.5 profile serves Kimi-K2.5."""
    if mla_ws is None:
        for check in ("int4-checkpoint", "generate"):
            report.put("SKIP", f"kimi/{check}", "the mla pipeline's setup failed")
        return
    try:
        t0 = time.monotonic()
        shapes = build_tiny_kimi_int4(mla_ws / KIMI_DIR, mla_ws / "data/verifier")
        packed = [k for k in shapes if k.endswith(".weight_packed")]
        report.put(
            "PASS",
            "kimi/int4-checkpoint",
            f"{len(packed)} routed-expert projections packed INT4 group 32 "
            f"(e.g. {packed[0]} {shapes[packed[0]]}) in {time.monotonic() - t0:.1f} s",
        )
    except Exception as e:  # any failure of the build is this check's FAIL line
        report.put("FAIL", "kimi/int4-checkpoint", f"{type(e).__name__}: {str(e)[:300]}")
        report.put("SKIP", "kimi/generate", "no checkpoint")
        return
    if not vllm:
        report.put("SKIP", "kimi/generate", NO_VLLM)
        return
    base = yaml.safe_load((mla_ws / "params.yaml").read_text())
    params = kimi_params(base, gpus)
    (mla_ws / KIMI_PARAMS).write_text(yaml.safe_dump(params, sort_keys=False))
    v = params["vllm"]
    how = f"TP {v['tensor_parallel_size']}, enforce_eager {v['enforce_eager']}"
    try:
        run_stage(mla_ws, "verifier", report.left_s(), KIMI_PARAMS)
        seconds = run_stage(mla_ws, "generate", report.left_s(), KIMI_PARAMS)
        rows = (mla_ws / "data/generated/train.jsonl").read_text().splitlines()
        rows = [json.loads(r) for r in rows if r.strip()]
        thought = sum(1 for r in rows if r.get("reasoning"))
        log_text = (mla_ws / "data/.work/generate/server.log").read_text(errors="replace")
        chosen = "; ".join(f"{k} {v}" for k, v in served_with(log_text).items())
        report.put(
            "PASS" if rows else "FAIL",
            "kimi/generate",
            f"{how}, kimi_k2 parser, top_p {params['generate']['top_p']}: {len(rows)} rows "
            f"({thought} with reasoning) in {seconds:.0f} s; {chosen}",
        )
    except (StageError, OSError, ValueError) as e:
        tail = ""
        log_file = mla_ws / "data/.work/generate/server.log"
        if log_file.is_file():
            chosen = served_with(log_file.read_text(errors="replace"))
            tail = "; " + "; ".join(f"{k} {v}" for k, v in chosen.items())
        report.put("FAIL", "kimi/generate", f"{how}: {e}{tail}")
