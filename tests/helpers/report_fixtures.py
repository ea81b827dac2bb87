"""A small git + DVC repo holding what `make report` reads: dvc.yaml's plots (the real section and
templates), metrics/eval.json with three drafters, provenance records with durations, a store
manifest and DVCLive series. No pipeline run: the report only reads these files."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
TEMPLATES = "src/eagle3_pipeline/report/templates"
STAGES = ("verifier", "prepare", "extract", "train", "evaluate")


def env() -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith("DVC_")}
    e["PATH"] = f"{Path(sys.executable).parent}:{e['PATH']}"
    e.update(DVC_NO_ANALYTICS="1", GIT_CONFIG_NOSYSTEM="1")
    return e


def run(cwd: Path, *cmd: str) -> str:
    proc = subprocess.run(cmd, cwd=cwd, env=env(), capture_output=True, text=True)
    assert proc.returncode == 0, f"{cmd}:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    return proc.stdout


def eval_doc(scale: float = 1.0) -> dict[str, Any]:
    def result(per_pos: list[float]) -> dict[str, Any]:
        p = [min(1.0, a * scale) for a in per_pos]
        return {
            "acceptance_per_position": p,
            "acceptance_rate": sum(p) / 3,
            "mean_acceptance_length": 1 + sum(p),
        }

    online = result([0.7, 0.6, 0.5]) | {
        "tokens_per_s": 200.0 * scale,
        "speedup": 1.3 * scale,
        "tokens_per_s_baseline": 150.0,
    }
    served = {
        name: {"mean_acceptance_length": 1 + sum(min(1.0, a * scale) for a in per_pos)}
        for name, per_pos in (("val", [0.7, 0.6, 0.5]), ("humaneval", [0.5, 0.3, 0.2]))
    }
    return {
        "served": {"num_speculative_tokens": 3, "sets": served},
        "num_speculative_tokens": 3,
        "offline": {
            "trained": result([0.8, 0.65, 0.55]),
            "untrained": result([0.01, 0, 0]),
            "init": result([0.4, 0.3, 0.2]),
        },
        "online": online,
    }


def write_metrics(root: Path, scale: float = 1.0) -> None:
    """Every file the report reads; `scale` makes a second revision differ."""
    (root / "metrics/provenance").mkdir(parents=True, exist_ok=True)
    (root / "metrics/eval.json").write_text(json.dumps(eval_doc(scale)))
    for i, stage in enumerate(STAGES):
        rec = {
            "stage": stage,
            "recorded_at": f"2026-01-01T00:0{i}:00+00:00",
            "duration_s": 10.0 * (i + 1) * scale,
            "git_commit": "0" * 40,
            "profile": "t",
        }
        (root / f"metrics/provenance/{stage}.json").write_text(json.dumps(rec))
    store = root / "data/hidden_states"
    store.mkdir(parents=True, exist_ok=True)
    samples = {f"p{i}": {"bytes": 1_000_000, "num_tokens": 100} for i in range(int(3 * scale))}
    manifest = {
        "bytes_per_token": 1024,
        "dtype": "bf16",
        "layer_ids": [2, 4, 5, 8],
        "hidden_size": 128,
        "num_tokens": 100 * len(samples),
        "samples": samples,
    }
    (store / "manifest.json").write_text(json.dumps(manifest))
    live = root / "metrics/train/plots/metrics"
    for rel in yaml.safe_load((REPO / "dvc.yaml").read_text())["plots"]:
        (_pid, props), *_ = rel.items()
        for path, field in props["y"].items():
            if path.startswith("metrics/train/"):
                (root / path).parent.mkdir(parents=True, exist_ok=True)
                rows = [f"{s}\t{(s + 1) * scale / 10}" for s in range(5)]
                (root / path).write_text("step\t" + field + "\n" + "\n".join(rows) + "\n")
    assert live.is_dir()
    curve = root / "metrics/curve"  # the curve stage's series (stages/curve.py)
    curve.mkdir(parents=True, exist_ok=True)
    points = [
        {"train_tokens": t, "tau": 1.5 + t / 4e5 * scale, "kind": "measured"}
        for t in (5e4, 1e5, 2e5)
    ] + [{"train_tokens": 4e5, "tau": 2.1 * scale, "kind": "predicted"}]
    (curve / "tokens.json").write_text(json.dumps(points))
    epochs = [{"epoch": e, "tau": 1.2 + 0.2 * e * scale} for e in (1, 2, 3)]
    (curve / "epochs.json").write_text(json.dumps(epochs))


def make_repo(root: Path) -> Path:
    """The fixture repo, committed once (HEAD); metrics as write_metrics(scale=1) writes them."""
    root.mkdir(parents=True)
    run(root, "git", "init", "-q")
    run(root, "git", "config", "user.email", "t@t")
    run(root, "git", "config", "user.name", "t")
    run(root, sys.executable, "-m", "dvc", "init", "-q")
    doc = yaml.safe_load((REPO / "dvc.yaml").read_text())
    (root / "dvc.yaml").write_text(yaml.safe_dump({"plots": doc["plots"]}, sort_keys=False))
    shutil.copytree(REPO / TEMPLATES, root / TEMPLATES)
    write_metrics(root)
    commit(root, "first")
    return root


def commit(root: Path, message: str) -> None:
    run(root, "git", "add", "-A")
    run(root, "git", "commit", "-qm", message)
