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
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from eagle3_pipeline.evaluation import speedup  # noqa: E402
from eagle3_pipeline.serving.served_with import served_with  # noqa: E402

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


# Without vLLM: hidden states from the HF backend, and the drafter judged offline.
WITHOUT_VLLM: dict[str, Any] = {"extract": {"backend": "hf"}, "evaluate": {"online": False}}
NO_VLLM = "vLLM is not installed here"


def vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


def pipeline_params(name: str, gpus: int = 1, vllm: bool = True) -> dict[str, Any]:
    """The pipeline's params; with two GPUs the MLA pipeline trains on both (torchrun, DDP)."""
    spec = PIPELINES[name]
    base = yaml.safe_load((REPO / "profiles" / f"{spec['profile']}.yaml").read_text())
    params = merge(merge(base, SHRINK), spec["over"])
    if name == "mla":
        params = merge(params, {"train": {"nproc": min(2, gpus), "strategy": "ddp"}})
    return params if vllm else merge(params, WITHOUT_VLLM)


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


def stage_command(stage: str, params_file: str = "params.yaml") -> list[str]:
    return [sys.executable, "-m", "eagle3_pipeline.cli", stage, "--params", params_file]


def run_stage(
    workspace: Path, stage: str, timeout_s: float, params_file: str = "params.yaml"
) -> float:
    """`eagle3 <stage>` in `workspace`; its wall seconds. StageError with its last output line."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", TQDM_DISABLE="1")
    # The copy's code first, as the image runs the mount's; a PYTHONPATH already set stays after.
    paths = [str(workspace / "src"), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, paths))
    cmd = stage_command(stage, params_file)
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
        lines = [x for x in (proc.stdout + proc.stderr).splitlines() if x.strip()]
        # The stage's own `error: ...` line, not the traceback or hint printed after it.
        reason = ([x for x in lines if x.startswith("error:")] or lines)[-1:]
        raise StageError(f"{stage} exited {proc.returncode}: {' '.join(reason)[:300]}")
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


# --- Kimi-K2.5's paths: the toolchain vLLM compiles with, and a tiny INT4 Kimi served --------

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
# Kimi-K2.5's quantization_config (tests/fixtures/kimi-k2.5/config.json): routed experts INT4,
# symmetric, one bf16 scale per 32 weights, packed 8 to an int32; the rest stays bf16.
KIMI_INT4 = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "quantization_status": "compressed",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {
                "num_bits": 4,
                "type": "int",
                "symmetric": True,
                "strategy": "group",
                "group_size": 32,
                "dynamic": False,
                "actorder": None,
                "block_structure": None,
                "observer": "minmax",
                "observer_kwargs": {},
            },
            "input_activations": None,
            "output_activations": None,
        }
    },
    "ignore": [
        "lm_head",
        "re:.*self_attn.*",
        "re:.*shared_experts.*",
        r"re:.*mlp\.(gate|up|gate_up|down)_proj.*",
    ],
    "kv_cache_scheme": None,
}
ROUTED_EXPERT = re.compile(r"\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")
# Kimi-K2.5's head dims (qk_nope = v = 128, MLA latent 512 + rope 64) and dims the INT4 MoE
# kernels take at TP 2 (moe_intermediate 512 = 256 per rank, a multiple of 128).
KIMI_TINY = {
    "architecture": "deepseek_v3",
    "num_hidden_layers": 3,  # 1 dense, then 2 MoE layers
    "hidden_size": 1024,
    "intermediate_size": 2048,  # moe_intermediate_size = 512
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "max_position_embeddings": 4096,
}
KIMI_DIR = "models/kimi-int4"
KIMI_PARAMS = "params-kimi.yaml"


def pack_int4(weight: Any) -> dict[str, Any]:
    """A routed expert's weight as compressed-tensors packs it (its own compressor):
    weight_packed int32 [out, in/8], weight_scale bf16 [out, in/32], weight_shape."""
    import torch
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams

    w = KIMI_INT4["config_groups"]["group_0"]["weights"]
    keys = ("num_bits", "type", "symmetric", "strategy", "group_size")
    args = QuantizationArgs(**{k: w[k] for k in keys})
    groups = weight.float().reshape(weight.shape[0], -1, w["group_size"])
    scale, zero = calculate_qparams(groups.amin(-1), groups.amax(-1), args)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    state = {"weight": weight.to(torch.bfloat16), "weight_scale": scale.to(torch.bfloat16)}
    return dict(PackedQuantizationCompressor.compress(state | {"weight_zero_point": zero}, scheme))


def build_tiny_kimi_int4(out_dir: Path, tokenizer_dir: Path, seed: int = 0) -> dict[str, Any]:
    """A random Kimi-K2.5 in miniature as the hub lays it out (verifier/tiny_kimi.py: wrapper,
    text_config, `language_model.` names), bf16, routed experts INT4 group 32 packed by
    compressed-tensors, Kimi's quantization_config. Returns {tensor name: shape}."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    from eagle3_pipeline.config.params import TinyVerifierParams
    from eagle3_pipeline.verifier.tiny_kimi import build_kimi_like, save_kimi_like

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(seed)
    model = build_kimi_like(TinyVerifierParams.model_validate(KIMI_TINY), tokenizer).eval()
    out_dir.mkdir(parents=True, exist_ok=True)
    save_kimi_like(model, out_dir)  # and reads it back through transformers
    tokenizer.save_pretrained(out_dir)
    weights = out_dir / "model.safetensors"
    tensors: dict[str, Any] = {}
    for name, value in load_file(weights).items():
        if ROUTED_EXPERT.search(name):
            module = name.removesuffix(".weight")
            tensors |= {f"{module}.{k}": v for k, v in pack_int4(value).items()}
        else:
            tensors[name] = value.to(torch.bfloat16) if value.is_floating_point() else value
    save_file(tensors, weights, metadata={"format": "pt"})
    config_file = out_dir / "config.json"
    config = json.loads(config_file.read_text())
    config["quantization_config"] = KIMI_INT4
    config["dtype"] = config["text_config"]["dtype"] = "bfloat16"
    config_file.write_text(json.dumps(config, indent=2) + "\n")
    return {k: list(v.shape) for k, v in tensors.items()}


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
