"""`make gpu-check`: the tiny pipeline's extract and train stages on one CUDA GPU in bf16.

One prepared check (under 5 minutes on one GPU) that the GPU path works end to end and how fast:
in a temp copy of the repo's tracked files it runs the tiny-llama profile, shrunk, with the
verifier served in bf16 (`vllm --dtype bfloat16`, bf16 store) and speculators training in bf16
(its default on CUDA), then prints tokens/s for extraction and training. The setup stages
(verifier, prepare, generate, tokenize) and vocab run too but are not measured. The workspace
is deleted afterwards (`--keep` keeps it). On a machine without CUDA it exits 2 with one line.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
SETUP_STAGES = ("verifier", "prepare", "generate", "tokenize", "vocab")
# The tiny-llama profile made smaller and faster; bf16 wherever the GPU computes.
OVERRIDES: dict[str, Any] = {
    "verifier": {"tiny": {"train_steps": 60}},
    "prepare": {"max_prompts": 96},
    "vllm": {"extra_args": ["--dtype", "bfloat16"], "enforce_eager": True},
    "generate": {"backend": "hf", "max_new_tokens": 96},
    "extract": {"backend": "vllm", "store_dtype": "bf16"},
    "train": {"epochs": 3, "max_tokens_per_batch": 2048},
    "evaluate": {"online": False},
}


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`base` with `over` merged in, recursively (a new dict; inputs untouched)."""
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


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


def copy_repo(dst: Path) -> Path:
    """The repo's tracked files (code, profiles, committed corpus and prompts) under `dst`."""
    files = subprocess.run(
        ["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True
    ).stdout.split(b"\0")
    for name in filter(None, (f.decode() for f in files)):
        target = dst / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, target)
    return dst


def run_stage(workspace: Path, stage: str) -> float:
    """`eagle3 <stage>` in `workspace`; its wall seconds. Raises with its output on failure."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", TQDM_DISABLE="1")
    cmd = [sys.executable, "-m", "eagle3_pipeline.cli", stage, "--params", "params.yaml"]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=workspace, env=env, capture_output=True, text=True)
    seconds = time.monotonic() - t0
    if proc.returncode != 0:
        raise RuntimeError(
            f"stage {stage} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    return seconds


def train_tokens(workspace: Path, epochs: int) -> int:
    """Tokens the train stage consumed: every train row's tokens, once per epoch."""
    rows = (workspace / "data/tokenized/train.jsonl").read_text().splitlines()
    return epochs * sum(len(json.loads(r)["input_ids"]) for r in rows if r.strip())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", action="store_true", help="keep the temp workspace")
    args = parser.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print(
            "gpu-check: no CUDA device (torch.cuda.is_available() is False): run it on a "
            "machine with an NVIDIA GPU and a CUDA build of torch, e.g. in the container",
            file=sys.stderr,
        )
        return 2
    device = torch.cuda.get_device_name(0)
    tmp = Path(tempfile.mkdtemp(prefix="eagle3-gpu-check-"))
    try:
        ws = copy_repo(tmp / "repo")
        base = yaml.safe_load((REPO / "profiles/tiny-llama.yaml").read_text())
        params = merge(base, OVERRIDES)
        (ws / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
        t0 = time.monotonic()
        for stage in SETUP_STAGES[:-1]:
            run_stage(ws, stage)
        setup_s = time.monotonic() - t0
        extract_s = run_stage(ws, "extract")
        run_stage(ws, "vocab")
        train_s = run_stage(ws, "train")

        manifest = json.loads((ws / "data/hidden_states/manifest.json").read_text())
        extracted = int(manifest["num_tokens"])
        trained = train_tokens(ws, params["train"]["epochs"])
        step_tps = median_step_tokens_per_s(
            ws / "metrics/train/plots/metrics/train/tokens_per_s.tsv"
        )
        print(f"gpu-check on {device} (bf16), workspace {ws}")
        print(f"setup stages (verifier, prepare, generate, tokenize): {setup_s:.1f} s")
        print(
            f"extract: {extracted} tokens in {extract_s:.1f} s = "
            f"{tokens_per_s(extracted, extract_s):,.0f} tokens/s (stage wall, engine start incl.)"
        )
        steps = f"; median per step {step_tps:,.0f} tokens/s" if step_tps else ""
        print(
            f"train: {trained} tokens in {train_s:.1f} s = "
            f"{tokens_per_s(trained, train_s):,.0f} tokens/s (stage wall){steps}"
        )
        return 0
    finally:
        if args.keep:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
