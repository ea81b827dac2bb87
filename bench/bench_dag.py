"""Benchmark: where a pipeline run's time goes, stage by stage.

Reads the `duration_s` every stage records in metrics/provenance/<stage>.json (the last run of
each stage in this workspace: run `make train` on an otherwise idle machine first) and prints
each stage's seconds and share of the total, against the target of the tiny profiles (300 s of
stages on a 2-core CPU machine). Writes bench/results/dag.json. `--repo DIR` reads another
checkout.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STAGES = ["verifier", "prepare", "generate", "tokenize", "extract", "vocab", "train", "export"]
STAGES += ["evaluate"]
TARGET_S = 300.0


def durations(repo: Path) -> dict[str, float]:
    out = {}
    for stage in STAGES:
        record = repo / "metrics/provenance" / f"{stage}.json"
        if record.is_file():
            out[stage] = float(json.loads(record.read_text()).get("duration_s") or 0.0)
    return out


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repo", type=Path, default=REPO)
    args = ap.parse_args(argv)
    got = durations(args.repo)
    if not got:
        print(f"no provenance records under {args.repo}/metrics/provenance: run `make train`")
        return 1
    total = sum(got.values())
    print(f"{'stage':<10} {'seconds':>8} {'share':>6}")
    for stage, s in got.items():
        print(f"{stage:<10} {s:>8.1f} {s / total:>6.1%}")
    print(f"{'total':<10} {total:>8.1f}  (target for the tiny profiles: {TARGET_S:.0f} s)")
    out = REPO / "bench/results/dag.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"durations_s": got, "total_s": total}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
