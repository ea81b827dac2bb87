"""bench/bench_cluster.py's split of a cluster stage's time: the work (the commands' own seconds,
from the provenance) and the engine's (the rest of the fan-out)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "bench"))

import bench_cluster  # noqa: E402


def test_extract_work_is_its_slowest_shard_with_its_reruns() -> None:
    record = {
        "shards": {"0/2": "a", "1/2": "b"},
        "fan_out_s": 40.0,
        "attempts": [
            {"shard": 0, "command_s": 10.0},  # lost, rerun below
            {"shard": 1, "command_s": 25.0},
            {"shard": 0, "command_s": 20.0},
        ],
    }
    assert bench_cluster.work_s(record) == 30.0


def test_train_work_adds_each_attempt_s_slowest_agent(tmp_path: Path) -> None:
    record = {
        "train_s": 100.0,
        "attempts": [
            {"agents": [{"command_s": 30.0}, {"command_s": 12.0}]},
            {"agents": [{"command_s": 50.0}, {"command_s": 55.0}]},
        ],
    }
    assert bench_cluster.work_s(record) == 85.0
    prov = tmp_path / "metrics/provenance"
    prov.mkdir(parents=True)
    (prov / "train.json").write_text(json.dumps({"cluster": record}))
    assert bench_cluster.engine_s(tmp_path, "train") == 15.0


def test_records_without_command_times_say_nothing() -> None:
    assert bench_cluster.work_s({"train_s": 9.0, "attempts": [{"agents": [{"rc": 0}]}]}) is None
    assert bench_cluster.work_s({"servers": {}, "lost": []}) is None  # generate
