"""The harness of `make gpu-check` (scripts/gpu_check.py): one `PASS|FAIL|SKIP <check>: <numbers>`
line per check within a time budget, a temp copy of the repo, and a stage run through the
pipeline's own CLI there (its `error:` line when it fails).
"""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`base` with `over` merged in, recursively (a new dict; inputs untouched)."""
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


NO_VLLM = "vLLM is not installed here"


def vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


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
