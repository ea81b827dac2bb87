"""What the report reads: dvc.yaml's plot definitions, DVC's own filled specs, raw files per rev.

DVC draws the plots it declares (`dvc plots show|diff --json`: Vega-Lite specs with the data
inlined), so the report and `dvc plots` agree. The summary series are derived again at every
revision from the raw files (series.py says why); a revision is read through DVC's file system,
which serves git-tracked files and DVC outputs (from the cache) alike, and accepts experiment
names as `dvc plots diff` does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import yaml

from eagle3_pipeline.core import paths
from eagle3_pipeline.core.errors import DataError
from eagle3_pipeline.report import series

WORKSPACE = "workspace"  # DVC's name for the working tree
DVC_YAML = Path("dvc.yaml")
MANIFEST = paths.HIDDEN_STATES / "manifest.json"


@dataclass
class PlotDef:
    """One entry of dvc.yaml's top-level `plots:` list."""

    id: str
    props: dict[str, Any]

    @property
    def files(self) -> list[str]:
        y = self.props.get("y")
        return list(y) if isinstance(y, dict) else [self.id]

    @property
    def series(self) -> str | None:
        """The summary series this plot draws (a file under metrics/report/), else None."""
        for f in self.files:
            p = PurePosixPath(f)
            if p.parent == PurePosixPath(series.SERIES_DIR.as_posix()) and p.stem in series.NAMES:
                return p.stem
        return None


@dataclass
class RevisionFiles:
    """The raw files one revision holds (None: absent), and why any could not be read."""

    rev: str
    eval: dict[str, Any] | None = None
    provenance: dict[str, dict[str, Any]] = field(default_factory=dict)
    manifest: dict[str, Any] | None = None
    # {branch name: its metrics/families/NAME/eval.json} (docs/families.md)
    families: dict[str, dict[str, Any]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)


def plot_defs(dvc_yaml: Path = DVC_YAML) -> list[PlotDef]:
    """dvc.yaml's top-level plots, in file order."""
    if not dvc_yaml.is_file():
        raise DataError(f"{dvc_yaml}: not found: run `make report` from the repo root")
    doc = yaml.safe_load(dvc_yaml.read_text()) or {}
    defs: list[PlotDef] = []
    for entry in doc.get("plots") or []:
        if isinstance(entry, dict):
            (pid, props), *_ = entry.items()
            defs.append(PlotDef(str(pid), dict(props or {})))
        else:
            defs.append(PlotDef(str(entry), {}))
    return defs


def dvc_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("DVC_NO_ANALYTICS", "1")
    return env


def dvc_plot_specs(revs: list[str]) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """{plot id: filled Vega-Lite spec} as DVC draws it for `revs` (none: the workspace), and
    DVC's errors as lines (a revision lacking a file: that plot is drawn from the others)."""
    cmd = [sys.executable, "-m", "dvc", "plots", "diff" if revs else "show", *revs, "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dvc_env())
    if proc.returncode != 0:
        raise DataError(
            f"`{' '.join(cmd[2:])}` failed: {(proc.stderr or proc.stdout).strip()[-400:]} "
            "(check dvc.yaml's plots: section and the revision names)"
        )
    doc = json.loads(proc.stdout)
    specs: dict[str, dict[str, Any]] = {}
    for pid, items in (doc.get("data") or {}).items():
        vega = [i for i in items if i.get("type") == "vega"]
        if vega:
            specs[pid] = vega[0]["content"]
    errors = [
        f"{e.get('rev', '?')}: {e.get('name', '')}: {e.get('msg', e)}"
        for e in doc.get("errors", [])
    ]
    return specs, errors


def _read_json(read: Any, path: str, problems: list[str]) -> Any:
    try:
        with read(path) as fh:
            return json.load(fh)
    except FileNotFoundError:
        return None
    except Exception as exc:  # a DVC output whose cache is not here, or a malformed file
        problems.append(f"{path}: {type(exc).__name__}: {str(exc)[:200]}")
        return None


def read_revision(rev: str) -> RevisionFiles:
    """eval.json, every provenance record and the store manifest as `rev` holds them."""
    out = RevisionFiles(rev)
    if rev == WORKSPACE:

        def read(p: str) -> Any:
            return open(p, encoding="utf-8")

        names = [p.name for p in sorted(paths.PROVENANCE.glob("*.json"))]
        branches = sorted(p.parent.name for p in paths.FAMILIES_METRICS.glob("*/eval.json"))
    else:
        from dvc.api import DVCFileSystem
        from dvc.repo import Repo
        from dvc.scm import resolve_rev

        with Repo(".") as repo:
            try:
                sha = resolve_rev(repo.scm, rev)
            except Exception as exc:
                raise DataError(
                    f"revision '{rev}': {exc} (give a commit, branch, tag or experiment name)"
                ) from exc
        fs = DVCFileSystem(".", rev=sha)

        def read(p: str) -> Any:
            return fs.open(p, mode="r", encoding="utf-8")

        prov = paths.PROVENANCE.as_posix()
        names = sorted(
            PurePosixPath(p).name for p in (fs.ls(prov, detail=False) if fs.isdir(prov) else [])
        )
        fam = paths.FAMILIES_METRICS.as_posix()
        listed = fs.ls(fam, detail=False) if fs.isdir(fam) else []
        branches = sorted(PurePosixPath(p).name for p in listed if fs.isfile(f"{p}/eval.json"))
    out.eval = _read_json(read, paths.EVAL_METRICS.as_posix(), out.problems)
    for name in names:
        if name.endswith(".json"):
            rec = _read_json(read, f"{paths.PROVENANCE.as_posix()}/{name}", out.problems)
            if isinstance(rec, dict):
                out.provenance[name.removesuffix(".json")] = rec
    out.manifest = _read_json(read, MANIFEST.as_posix(), out.problems)
    for name in branches:
        doc = _read_json(
            read, f"{paths.FAMILIES_METRICS.as_posix()}/{name}/eval.json", out.problems
        )
        if isinstance(doc, dict):
            out.families[name] = doc
    for what, value in (("metrics/eval.json", out.eval), (MANIFEST.as_posix(), out.manifest)):
        if value is None and not any(p.startswith(what) for p in out.problems):
            out.problems.append(f"{what}: not in this revision")
    return out
