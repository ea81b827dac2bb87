"""`make gpu-check`: every question the CPU cannot answer, in one run on one or two CUDA GPUs
(< 10 min).

One line per check, `PASS|FAIL|SKIP <check>: <numbers>`, in this order:
  device        GPU, compute capability in torch's arch list, driver >= the wheels' CUDA minimum
  toolchain     what vLLM compiles at run time: nvcc (CUDA_HOME) builds a tiny kernel for this
                GPU into FlashInfer's JIT cache, and every kernel cache and HOME are writable
  uid           the uid it runs as (the image runs any: `-u $(id -u)`), HOME and caches its own
  bf16-matmul   a bf16 GEMM: TFLOP/s and agreement with fp32
  llama/*       tiny-llama in bf16 through the pipeline's own CLI (`eagle3 <stage>`, the stable
                entry point): extract with vLLM's STOCK hidden-states connector, speculators
                training in bf16, vLLM serving the verifier with the drafter (online acceptance,
                greedy outputs with and without it judged as vLLM judges its own: identical
                or diverged only at near ties)
  mla/*         the same for tiny-dsv3 (DeepSeek-V3 MLA + MoE verifier, Kimi-K2.5 layout): the
                stock connector on an MLA verifier, training on `nproc` = min(2, GPUs) ranks
                (torchrun, DDP), and vLLM serving the MLA verifier + drafter
  kimi/*        Kimi-K2.5's serving path in miniature: a tiny Kimi-K2.5 wrapper checkpoint
                (text_config, `language_model.` names) whose routed experts are INT4 group 32,
                packed by compressed-tensors as Kimi's are; then the generate stage serves it
                with TP = min(2, GPUs), enforce_eager false (torch.compile + CUDA graphs), the
                kimi_k2 reasoning parser and top-p sampling, and prints the model runner and the
                attention/MoE backends vLLM chose (from the server log)
Each pipeline runs in a temp copy of the repo's tracked files (deleted unless `--keep`). A check
whose input failed prints SKIP with the reason; checks past the time budget print SKIP (budget).
Where vLLM is not installed (a bare GPU box with torch; docs/gpus.md), every vLLM check prints
SKIP and the rest still runs: extract with the HF backend (in-process, on the CPU:
`*/extract-hf`), then training and the trained drafter's offline acceptance on the GPU
(`*/acceptance-offline`).
Exit 0 when every check passed, 1 otherwise, 2 on a machine without CUDA (one line).
`--plan [--gpus N]` prints the checks it would run and their commands and configs, on any machine.
This file holds the machine's checks and the run; the pipelines' checks are gpu_check_pipelines.py,
the harness (report, budget, stage runs) gpu_check_harness.py, the INT4 Kimi gpu_check_kimi_int4.py.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its parts: scripts/gpu_check_*.py
from gpu_check_harness import Report, stage_command, vllm_installed  # noqa: E402
from gpu_check_kimi_int4 import KIMI_INT4, KIMI_TINY  # noqa: E402
from gpu_check_pipelines import (  # noqa: E402
    KIMI_DIR,
    KIMI_PARAMS,
    PIPELINES,
    SETUP_STAGES,
    check_kimi,
    check_pipeline,
    kimi_params,
    pipeline_params,
)

BUDGET_S = 570.0  # the whole run, under 10 minutes
# CUDA major.minor of the wheels (locks/cuda.txt) -> oldest Linux driver that runs it (NVIDIA's
# CUDA 13.0 release notes: 580.65.06; a newer 13.x minor runs on it by minor-version compatibility).
MIN_DRIVER = {"13.0": "580.65.06"}


def version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", version))


def driver_verdict(driver: str, cuda: str) -> tuple[bool, str]:
    """Whether `driver` runs CUDA `cuda` (major.minor), and the sentence that says so."""
    minimum = MIN_DRIVER.get(cuda)
    if minimum is None:
        return False, f"driver {driver}: no known minimum for CUDA {cuda} (update MIN_DRIVER)"
    ok = version_tuple(driver) >= version_tuple(minimum)
    return ok, f"driver {driver} {'>=' if ok else '<'} {minimum} (CUDA {cuda})"


# --- the machine: the toolchain vLLM compiles with (Kimi-K2.5's paths), the uid ------------

# Where the image points every compiler and kernel cache (Dockerfile); HOME last.
CACHE_VARS = (
    "TRITON_CACHE_DIR",
    "TORCHINDUCTOR_CACHE_DIR",
    "VLLM_CACHE_ROOT",
    "FLASHINFER_WORKSPACE_BASE",
    "HUMMING_CACHE_DIR",
    "CUDA_CACHE_PATH",
    "HOME",
)
IMAGE_UID = 1000  # the Dockerfile's USER; `make docker ...` runs as the caller's uid instead
NVCC_PROBE = r"""
#include <cuda_runtime.h>
#include <cuda_bf16.h>
__global__ void probe(__nv_bfloat16* x) { x[threadIdx.x] = __float2bfloat16(1.0f); }
"""


def nvcc_command(source: Path, arch: str) -> list[str]:
    cuda_home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    return [
        f"{cuda_home}/bin/nvcc",
        f"-gencode=arch=compute_{arch},code=sm_{arch}",
        "-c",
        str(source),
        "-o",
        str(source.with_suffix(".o")),
    ]


def writable(path: Path) -> bool:
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".gpu-check-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
        return True
    except OSError:
        return False


def check_toolchain(report: Report) -> None:
    """nvcc builds a bf16 kernel for this GPU into FlashInfer's JIT folder (where FlashInfer's
    and Humming's JIT builds go with the same compiler and headers); every cache is writable."""
    import torch

    major, minor = torch.cuda.get_device_capability(0)
    arch = f"{major}{minor}{'a' if major in (9, 10) else ''}"
    base = Path(os.environ.get("FLASHINFER_WORKSPACE_BASE", Path.home()))
    jit = base / ".cache" / "flashinfer" / "gpu-check"
    bad = [v for v in CACHE_VARS if os.environ.get(v) and not writable(Path(os.environ[v]))]
    if not writable(jit):
        report.put("FAIL", "toolchain", f"{jit} not writable (FLASHINFER_WORKSPACE_BASE)")
        return
    source = jit / "probe.cu"
    source.write_text(NVCC_PROBE)
    t0 = time.monotonic()
    try:
        proc = subprocess.run(nvcc_command(source, arch), capture_output=True, text=True)
    except FileNotFoundError as e:
        report.put("FAIL", "toolchain", f"no nvcc ({e.filename}): build the image FROM -devel")
        return
    seconds = time.monotonic() - t0
    if proc.returncode != 0:
        report.put("FAIL", "toolchain", f"nvcc exited {proc.returncode}: {proc.stderr[-300:]}")
        return
    version = re.search(
        r"release (\S+),", subprocess.getoutput(f"{nvcc_command(source, arch)[0]} --version")
    )
    unset = [v for v in CACHE_VARS if not os.environ.get(v)]
    ok = not bad
    report.put(
        "PASS" if ok else "FAIL",
        "toolchain",
        f"nvcc {version[1] if version else '?'} built sm_{arch} in {seconds:.1f} s into {jit}; "
        f"caches {'writable' if ok else 'NOT writable: ' + ' '.join(bad)}"
        + (f"; unset: {' '.join(unset)}" if unset else ""),
    )


def check_uid(report: Report) -> None:
    import pwd

    uid = os.getuid()
    try:
        name = pwd.getpwuid(uid).pw_name
    except KeyError:
        name = "no passwd entry"
    home_ok = writable(Path.home())
    detail = f"uid {uid} ({name}), HOME {Path.home()} {'writable' if home_ok else 'NOT writable'}"
    if not home_ok:
        report.put("FAIL", "uid", detail)
    elif uid == IMAGE_UID:
        report.put("SKIP", "uid", f"{detail}; the image's own uid: run as another to check")
    else:
        report.put("PASS", "uid", detail)


def planned_checks(gpus: int) -> list[dict[str, Any]]:
    """What a run on `gpus` GPUs would do, check by check: the commands and configs."""
    plan: list[dict[str, Any]] = [
        {"check": "device", "what": "torch.cuda device 0, its arch in torch's list, the driver"},
        {
            "check": "toolchain",
            "command": nvcc_command(
                Path("$FLASHINFER_WORKSPACE_BASE/.cache/flashinfer/x.cu"), "90a"
            ),
            "caches": list(CACHE_VARS),
        },
        {"check": "uid", "what": f"HOME writable; SKIP when run as the image's uid {IMAGE_UID}"},
        {"check": "bf16-matmul", "what": "8192^3 bf16 GEMM vs fp32"},
    ]
    for name in PIPELINES:
        params = pipeline_params(name, gpus)
        stages = [*SETUP_STAGES, "extract", "vocab", "train", "export", "evaluate"]
        plan.append(
            {
                "check": f"{name}/*",
                "commands": ["eagle3 " + " ".join(stage_command(s)[3:]) for s in stages],
                "params": params,
            }
        )
    plan.append(
        {
            "check": "kimi/int4-checkpoint",
            "what": f"build_tiny_kimi_int4 into {KIMI_DIR}",
            "text_config": KIMI_TINY,
            "quantization_config": KIMI_INT4,
        }
    )
    plan.append(
        {
            "check": "kimi/generate",
            "commands": [
                "eagle3 " + " ".join(stage_command(s, KIMI_PARAMS)[3:])
                for s in ("verifier", "generate")
            ],
            "params": kimi_params({}, gpus),
        }
    )
    return plan


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
        "--only",
        choices=[*sorted(PIPELINES), "kimi"],
        action="append",
        help="run only these pipelines (kimi needs mla's setup)",
    )
    parser.add_argument(
        "--plan", action="store_true", help="print the checks, commands and configs; run nothing"
    )
    parser.add_argument("--gpus", type=int, default=None, help="GPUs to plan for (--plan)")
    args = parser.parse_args(argv)
    if args.plan:
        print(json.dumps(planned_checks(args.gpus or 2), indent=2))
        return 0

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
    gpus = min(2, torch.cuda.device_count())
    vllm = vllm_installed()
    check_device(report)
    check_toolchain(report)
    check_uid(report)
    check_bf16_matmul(report)
    torch.cuda.empty_cache()
    tmp = Path(tempfile.mkdtemp(prefix="eagle3-gpu-check-"))
    only = args.only or [*PIPELINES, "kimi"]
    try:
        workspaces = {
            name: check_pipeline(name, report, tmp, gpus, vllm)
            for name in PIPELINES
            if name in only or (name == "mla" and "kimi" in only)
        }
        if "kimi" in only:
            check_kimi(report, workspaces.get("mla"), gpus, vllm)
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
