"""`make gpu-check`: every question the CPU cannot answer, in one run on one CUDA GPU (< 10 min).

One line per check, `PASS|FAIL|SKIP <check>: <numbers>`, in this order:
  device        GPU, compute capability in torch's arch list, driver >= the wheels' CUDA minimum
  bf16-matmul   a bf16 GEMM: TFLOP/s and agreement with fp32
  llama/*       tiny-llama in bf16 through the pipeline's own CLI (`eagle3 <stage>`, the stable
                entry point): extract with vLLM's STOCK hidden-states connector, speculators
                training in bf16, vLLM serving the verifier with the drafter (online acceptance,
                greedy outputs with and without it judged as vLLM judges its own: identical
                or diverged only at near ties)
  mla/*         the same for tiny-dsv3 (DeepSeek-V3 MLA + MoE verifier, Kimi-K2.5 layout): the
                stock connector on an MLA verifier, and vLLM serving the MLA verifier + drafter
Each pipeline runs in a temp copy of the repo's tracked files (deleted unless `--keep`). A check
whose input failed prints SKIP with the reason; checks past the time budget print SKIP (budget).
Exit 0 when every check passed, 1 otherwise, 2 on a machine without CUDA (one line).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
BUDGET_S = 570.0  # the whole run, under 10 minutes
# CUDA major.minor of the wheels (locks/cuda.txt) -> oldest Linux driver that runs it (NVIDIA's
# CUDA 13.0 release notes: 580.65.06; a newer 13.x minor runs on it by minor-version compatibility).
MIN_DRIVER = {"13.0": "580.65.06"}
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


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`base` with `over` merged in, recursively (a new dict; inputs untouched)."""
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def pipeline_params(name: str) -> dict[str, Any]:
    spec = PIPELINES[name]
    base = yaml.safe_load((REPO / "profiles" / f"{spec['profile']}.yaml").read_text())
    return merge(merge(base, SHRINK), spec["over"])


def tokens_per_s(tokens: int, seconds: float) -> float:
    if seconds <= 0:
        raise ValueError(f"seconds={seconds} must be > 0")
    return tokens / seconds


def median_step_tokens_per_s(tsv: Path) -> float | None:
    """Median of the trainer's per-step tokens/s (DVCLive series); None when absent."""
    if not tsv.is_file():
        return None
    with open(tsv) as fh:
        values = [float(r["tokens_per_s"]) for r in csv.DictReader(fh, delimiter="\t")]
    return statistics.median(values) if values else None


def version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", version))


def driver_verdict(driver: str, cuda: str) -> tuple[bool, str]:
    """Whether `driver` runs CUDA `cuda` (major.minor), and the sentence that says so."""
    minimum = MIN_DRIVER.get(cuda)
    if minimum is None:
        return False, f"driver {driver}: no known minimum for CUDA {cuda} (update MIN_DRIVER)"
    ok = version_tuple(driver) >= version_tuple(minimum)
    return ok, f"driver {driver} {'>=' if ok else '<'} {minimum} (CUDA {cuda})"


def line(status: str, check: str, detail: str) -> str:
    return f"{status} {check}: {detail}"


class Report:
    """Prints one line per check as it finishes; remembers whether everything passed."""

    def __init__(self, budget_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.deadline = clock() + budget_s
        self.lines: list[str] = []

    def left_s(self) -> float:
        return self.deadline - self.clock()

    def put(self, status: str, check: str, detail: str) -> None:
        self.lines.append(line(status, check, detail))
        print(self.lines[-1], flush=True)

    @property
    def passed(self) -> bool:
        return all(x.startswith("PASS") for x in self.lines)


def copy_repo(dst: Path) -> Path:
    """The repo's tracked files (code, profiles, committed corpus and prompts) under `dst`."""
    files = subprocess.run(
        ["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True
    ).stdout.split(b"\0")
    for name in filter(None, (f.decode() for f in files)):
        if (REPO / name).is_file():
            target = dst / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, target)
    return dst


class StageError(RuntimeError):
    pass


def run_stage(workspace: Path, stage: str, timeout_s: float) -> float:
    """`eagle3 <stage>` in `workspace`; its wall seconds. StageError with its last output line."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", TQDM_DISABLE="1")
    env["PYTHONPATH"] = str(workspace / "src")  # the copy's code, as the image runs the mount's
    cmd = [sys.executable, "-m", "eagle3_pipeline.cli", stage, "--params", "params.yaml"]
    if timeout_s <= 0:
        raise StageError("time budget spent")
    t0 = time.monotonic()
    try:
        proc = subprocess.run(
            cmd, cwd=workspace, env=env, capture_output=True, text=True, timeout=timeout_s
        )
    except subprocess.TimeoutExpired as e:
        raise StageError(f"{stage} still running after {timeout_s:.0f} s (budget)") from e
    seconds = time.monotonic() - t0
    if proc.returncode != 0:
        (workspace / f"{stage}.log").write_text(proc.stdout + proc.stderr)
        tail = [x for x in (proc.stdout + proc.stderr).splitlines() if x.strip()][-1:]
        raise StageError(f"{stage} exited {proc.returncode}: {' '.join(tail)[:300]}")
    return seconds


def train_tokens(workspace: Path, epochs: int) -> int:
    """Tokens the train stage consumed: every train row's tokens, once per epoch."""
    rows = (workspace / "data/tokenized/train.jsonl").read_text().splitlines()
    return epochs * sum(len(json.loads(r)["input_ids"]) for r in rows if r.strip())


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
        f"{online.get('acceptance_rate', float('nan')):.1%}, x{online.get('speedup', 0):.2f} "
        f"tokens/s, greedy identical {identical}, lossless {verdict}{near}, MISMATCH {mismatch}"
    )
    return (not mismatch and verdict != "diverged"), detail


def check_pipeline(name: str, report: Report, tmp: Path) -> None:
    """One tiny pipeline: extract (stock connector), train (bf16), serve verifier + drafter."""
    params = pipeline_params(name)
    ws = copy_repo(tmp / name)
    (ws / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    try:
        for stage in SETUP_STAGES:
            run_stage(ws, stage, report.left_s())
    except StageError as e:
        report.put("FAIL", f"{name}/setup", str(e))
        for check in ("extract", "train-bf16", "serve-eagle3"):
            report.put("SKIP", f"{name}/{check}", "setup failed")
        return
    try:
        extract_s = run_stage(ws, "extract", report.left_s())
        manifest = json.loads((ws / "data/hidden_states/manifest.json").read_text())
        n = int(manifest["num_tokens"])
        report.put(
            "PASS",
            f"{name}/extract",
            f"stock ExampleHiddenStatesConnector, {n} tokens in {extract_s:.1f} s = "
            f"{tokens_per_s(n, extract_s):,.0f} tokens/s (engine start incl.)",
        )
    except (StageError, OSError, KeyError, ValueError) as e:
        report.put("FAIL", f"{name}/extract", str(e))
        report.put("SKIP", f"{name}/train-bf16", "no hidden states")
        report.put("SKIP", f"{name}/serve-eagle3", "no hidden states")
        return
    try:
        run_stage(ws, "vocab", report.left_s())
        train_s = run_stage(ws, "train", report.left_s())
        trained = train_tokens(ws, params["train"]["epochs"])
        step = median_step_tokens_per_s(ws / "metrics/train/plots/metrics/train/tokens_per_s.tsv")
        steps = f"; median step {step:,.0f} tokens/s" if step else ""
        report.put(
            "PASS",
            f"{name}/train-bf16",
            f"{trained} tokens in {train_s:.1f} s = {tokens_per_s(trained, train_s):,.0f} "
            f"tokens/s{steps}",
        )
    except (StageError, OSError, ValueError) as e:
        report.put("FAIL", f"{name}/train-bf16", str(e))
        report.put("SKIP", f"{name}/serve-eagle3", "no drafter")
        return
    try:
        run_stage(ws, "export", report.left_s())
        eval_s = run_stage(ws, "evaluate", report.left_s())
        ok, detail = online_detail(json.loads((ws / "metrics/eval.json").read_text()))
        report.put("PASS" if ok else "FAIL", f"{name}/serve-eagle3", f"{detail}; {eval_s:.0f} s")
    except (StageError, OSError, ValueError) as e:
        report.put("FAIL", f"{name}/serve-eagle3", str(e))


def check_device(report: Report) -> bool:
    import torch

    name = torch.cuda.get_device_name(0)
    major, minor = torch.cuda.get_device_capability(0)
    arch = f"sm_{major}{minor}"
    archs = torch.cuda.get_arch_list()
    cuda = ".".join(torch.version.cuda.split(".")[:2])
    try:
        import pynvml  # nvidia-ml-py, in locks/cuda.txt

        pynvml.nvmlInit()
        driver = pynvml.nvmlSystemGetDriverVersion()
        driver = driver.decode() if isinstance(driver, bytes) else driver
    except Exception:  # no NVML: the CLI the driver ships
        driver = (
            subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
            )
            .stdout.split("\n")[0]
            .strip()
            or "unknown"
        )
    driver_ok, driver_text = driver_verdict(driver, cuda)
    ok = driver_ok and arch in archs
    report.put(
        "PASS" if ok else "FAIL",
        "device",
        f"{name} {arch} ({'in' if arch in archs else 'NOT in'} torch's {' '.join(archs)}), "
        f"{driver_text}, torch {torch.__version__}",
    )
    return ok


def check_bf16_matmul(report: Report) -> None:
    import torch

    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    reps = 20
    t0 = time.monotonic()
    for _ in range(reps):
        c = a @ b
    torch.cuda.synchronize()
    seconds = time.monotonic() - t0
    ref = a[:256].float() @ b.float()
    err = ((c[:256].float() - ref).norm() / ref.norm()).item()
    ok = err < 1e-2
    tflops = 2 * n**3 * reps / seconds / 1e12
    detail = f"{tflops:,.0f} TFLOP/s ({n}^3), relative error vs fp32 {err:.1e}"
    report.put("PASS" if ok else "FAIL", "bf16-matmul", detail)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", action="store_true", help="keep the temp workspaces")
    parser.add_argument("--budget-s", type=float, default=BUDGET_S, help="whole-run time limit")
    parser.add_argument(
        "--only", choices=sorted(PIPELINES), action="append", help="run only these pipelines"
    )
    args = parser.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print(
            "gpu-check: no CUDA device (torch.cuda.is_available() is False): run it on a "
            "machine with an NVIDIA GPU and a CUDA build of torch, e.g. in the container",
            file=sys.stderr,
        )
        return 2
    report = Report(args.budget_s)
    t0 = time.monotonic()
    check_device(report)
    check_bf16_matmul(report)
    torch.cuda.empty_cache()
    tmp = Path(tempfile.mkdtemp(prefix="eagle3-gpu-check-"))
    try:
        for name in args.only or list(PIPELINES):
            check_pipeline(name, report, tmp)
    finally:
        if args.keep:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    verdict = "all passed" if report.passed else "NOT all passed"
    print(f"gpu-check: {len(report.lines)} checks, {verdict}, {time.monotonic() - t0:.0f} s")
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
