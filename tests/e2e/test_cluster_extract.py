"""extract on a real 2-node Ray cluster (two `ray start` nodes on this machine): the shards run on
both nodes, a node killed mid-shard has its shard redone on the other one from its journal, and
the merged store is byte-identical to a one-machine run's."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml
from extract_workdir import load_params, make_workdir, store_hashes
from ray_cluster import env, kill_worker_node, local_cluster

from eagle3_pipeline.stages import extract

pytestmark = [pytest.mark.slow, pytest.mark.cluster]
N, BUDGET = 40, 300

# In the shard processes only: each journaled batch takes a little longer, so that a node can be
# killed while its shard still has batches to do.
SLOW_SHARDS = """
import sys, time
if "--shard" in sys.argv:
    from eagle3_pipeline.stages import extract as _x
    _write = _x.write_batch
    def _slow(*a, **k):
        time.sleep(0.4)
        return _write(*a, **k)
    _x.write_batch = _slow
"""


def _journal_lines(root: Path, argv: str) -> int:
    shard = re.search(r"--shard (\d+)/(\d+)", argv)
    if not shard:
        return 0
    name = f"entries.shard-{shard[1]}-of-{shard[2]}.jsonl"
    return sum(len(p.read_text().splitlines()) for p in root.glob(f"data/.work/extract/**/{name}"))


def test_extract_fans_out_survives_a_lost_node_and_gives_the_same_store(
    tiny_verifier_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    one, cluster = tmp_path / "one", tmp_path / "cluster"
    for root in (one, cluster):
        make_workdir(root, tiny_verifier_dir, N, BUDGET)
    monkeypatch.chdir(one)
    extract.run(load_params(one))
    single = store_hashes(one)

    raw = yaml.safe_load((cluster / "params.yaml").read_text())
    raw["cluster"] = {"engine": "ray", "nodes": 2, "wait_for_nodes_s": 30}
    (cluster / "params.yaml").write_text(yaml.safe_dump(raw))
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SLOW_SHARDS)
    with local_cluster(cluster) as state:
        killed: list[str | None] = []
        killer = threading.Thread(
            target=lambda: killed.append(
                kill_worker_node(state, "--shard", lambda a: _journal_lines(cluster, a) >= 1)
            )
        )
        killer.start()
        run = subprocess.run(
            [sys.executable, "-m", "eagle3_pipeline.cli", "extract", "--params", "params.yaml"],
            cwd=cluster,
            env=env(site),
            capture_output=True,
            text=True,
            timeout=900,
        )
        killer.join(timeout=5)
    log = run.stdout + run.stderr
    assert run.returncode == 0, log[-4000:]
    assert killed and killed[0], f"no shard ran on the worker node:\n{log[-4000:]}"
    lost = re.search(r"--shard (\d+)/2", killed[0])[1]
    assert f"cluster: shard {lost}/2 lost on" in log, log[-4000:]
    for i in (0, 1):  # each worker line reaches the driver once (not once per node)
        assert log.count(f"shard {i}/2: done (") == 1, log[-4000:]

    record = json.loads((cluster / "metrics/provenance/extract.json").read_text())["cluster"]
    assert len(set(record["nodes"])) == 2  # distinct Ray node ids
    attempts = [a for a in record["attempts"] if a["shard"] == int(lost)]
    assert [a["rc"] == 0 for a in attempts] == [False, True]
    assert attempts[0]["node"] != attempts[1]["node"]  # redone elsewhere
    assert set(record["shards"]) == {"0/2", "1/2"}

    assert store_hashes(cluster) == single  # byte-identical: manifest and every file
    assert not list((cluster / "data/.work/cluster").glob("probe*"))
