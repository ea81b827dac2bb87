"""Benchmark: each stage on one node vs a Ray cluster, and whether its outputs are the same bytes.

Compares two workspaces that ran the same DAG: `--single` (e.g. `make train PROFILE=tiny-llama`)
and `--cluster` (`make cluster-local NODES=2`, then `make train PROFILE=tiny-llama-cluster`).
For each stage it prints the seconds of its last run in each (metrics/provenance/<stage>.json),
the difference, the nodes that did the cluster run's part, and whether the stage's outputs have
the same DVC hash in both dvc.lock files (same hash: the same bytes). On one 2-core machine the
cluster cannot be faster: the difference is the engine's overhead (nodes, fan-out, rendezvous).
Writes bench/results/cluster.json. Without both workspaces it says how to make them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml
from bench_dag import STAGES, durations

REPO = Path(__file__).resolve().parents[1]


def out_hashes(repo: Path) -> dict[str, dict[str, str]]:
    """stage -> {output path: DVC hash} from the workspace's dvc.lock."""
    lock = repo / "dvc.lock"
    if not lock.is_file():
        return {}
    stages = yaml.safe_load(lock.read_text()).get("stages", {})
    return {
        name: {o["path"]: o.get("md5") or o.get("hash", "") for o in s.get("outs", [])}
        for name, s in stages.items()
    }


def cluster_nodes(repo: Path, stage: str) -> list[str]:
    record = repo / "metrics/provenance" / f"{stage}.json"
    if not record.is_file():
        return []
    cluster = json.loads(record.read_text()).get("cluster") or {}
    return sorted(set(cluster.get("nodes") or cluster.get("servers") or []))  # generate: servers


def work_s(record: dict) -> float | None:
    """Seconds the fanned-out commands themselves ran (the work), from a cluster record: extract,
    the slowest shard (its attempts added up, shards run side by side); train, the slowest agent
    of each attempt, added up. None when the record does not say (generate, an older run)."""
    attempts = record.get("attempts") or []
    if "shards" in record:
        per_shard: dict[int, float] = {}
        for a in attempts:
            if a.get("command_s") is None:
                return None
            per_shard[a["shard"]] = per_shard.get(a["shard"], 0.0) + a["command_s"]
        return max(per_shard.values(), default=None)
    if "train_s" in record:
        total = 0.0
        for a in attempts:
            times = [x.get("command_s") for x in a.get("agents", [])]
            if not times or None in times:
                return None
            total += max(times)
        return total
    return None


def engine_s(repo: Path, stage: str) -> float | None:
    """The engine's own seconds in a cluster stage: the fan-out's wall time less the work."""
    record = repo / "metrics/provenance" / f"{stage}.json"
    if not record.is_file():
        return None
    cluster = json.loads(record.read_text()).get("cluster") or {}
    work = work_s(cluster)
    wall = cluster.get("fan_out_s", cluster.get("train_s"))
    return None if work is None or wall is None else round(wall - work, 1)


def compare(single: Path, cluster: Path) -> list[dict]:
    one, two = durations(single), durations(cluster)
    h1, h2 = out_hashes(single), out_hashes(cluster)
    rows = []
    for stage in STAGES:
        if stage not in one or stage not in two:
            continue
        same = bool(h1.get(stage)) and h1.get(stage) == h2.get(stage)
        rows.append(
            {
                "stage": stage,
                "single_s": one[stage],
                "cluster_s": two[stage],
                "overhead_s": round(two[stage] - one[stage], 1),
                "engine_s": engine_s(cluster, stage),
                "nodes": cluster_nodes(cluster, stage),
                "same_outputs": same,
            }
        )
    return rows


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--single", type=Path, help="workspace of the one-node run")
    ap.add_argument("--cluster", type=Path, help="workspace of the cluster run")
    args = ap.parse_args(argv)
    if not (args.single and args.cluster):
        print(
            "bench_cluster: not run: give --single DIR (make train PROFILE=tiny-llama) and "
            "--cluster DIR (make cluster-local NODES=2; make train PROFILE=tiny-llama-cluster), "
            "two clones of the same commit"
        )
        return 0
    rows = compare(args.single, args.cluster)
    if not rows:
        print(f"no stage ran in both {args.single} and {args.cluster}: run the DAG in each")
        return 1
    print(
        f"{'stage':<10} {'1 node s':>9} {'cluster s':>10} {'diff s':>8} {'engine s':>9}  "
        f"{'same bytes':<10} nodes"
    )
    for r in rows:
        engine = "-" if r["engine_s"] is None else f"{r['engine_s']:.1f}"
        print(
            f"{r['stage']:<10} {r['single_s']:>9.1f} {r['cluster_s']:>10.1f} "
            f"{r['overhead_s']:>+8.1f} {engine:>9}  {'yes' if r['same_outputs'] else 'no':<10} "
            f"{len(r['nodes']) or '-'}"
        )
    print(
        "engine s: the fan-out's wall time less the commands' own (Ray, scheduling, launch); "
        "the rest of the difference is the work itself sharing this machine's cores"
    )
    total1 = sum(r["single_s"] for r in rows)
    total2 = sum(r["cluster_s"] for r in rows)
    print(f"{'total':<10} {total1:>9.1f} {total2:>10.1f} {total2 - total1:>+8.1f}")
    out = REPO / "bench/results/cluster.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"stages": rows, "single_s": total1, "cluster_s": total2}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
