"""The shard fan-out's decisions, with a fake engine: where shards go, what a lost one does."""

from __future__ import annotations

from collections import deque

import pytest

from eagle3_pipeline.cluster import engine, shards
from eagle3_pipeline.config.training_params import ClusterParams
from eagle3_pipeline.core.errors import PipelineError

A, B = engine.Node("a" * 56, "10.0.0.1"), engine.Node("b" * 56, "10.0.0.2")


class FakeEngine:
    """Workers finish in submission order with scripted exit codes (None: lost with its node)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, script: dict, dead: set[str] = frozenset()):
        self.script = {k: deque(v) for k, v in script.items()}  # shard -> exit codes, in turn
        self.dead = set(dead)
        self.submitted: list[tuple[str, str]] = []  # (shard argument, node label)
        self.queue: deque = deque()
        monkeypatch.setattr(engine, "choose_nodes", lambda c, **_: [A, B][: c.nodes])
        monkeypatch.setattr(engine, "alive_nodes", self.alive)
        monkeypatch.setattr(engine, "submit", self.submit)
        monkeypatch.setattr(engine, "wait_any", lambda refs: self.queue[0][0])
        monkeypatch.setattr(engine, "outcome", self.outcome)
        monkeypatch.setattr(engine, "cancel", lambda refs: None)

    def alive(self) -> list[engine.Node]:
        return [n for n in (A, B) if n.node_id not in self.dead]

    def submit(self, node: engine.Node, argv: list[str], c: ClusterParams) -> int:
        shard = argv[argv.index("--shard") + 1]
        self.submitted.append((shard, node.label))
        ref = len(self.submitted)
        self.queue.append((ref, shard, node))
        return ref

    def outcome(self, node: engine.Node, ref) -> engine.Outcome:
        _, shard, _ = self.queue.popleft()
        rc = self.script[shard].popleft()
        if rc is None:
            self.dead.add(node.node_id)
        return engine.Outcome(
            node, rc, "NodeDiedError: gone" if rc is None else "", node_died=rc is None
        )


def test_each_node_runs_one_shard_and_provenance_says_which() -> None:
    c = ClusterParams(engine="ray", nodes=2)
    with pytest.MonkeyPatch.context() as mp:
        fake = FakeEngine(mp, {"0/2": [0], "1/2": [0]})
        record = shards.run_shards("extract", "params.yaml", c)
    assert fake.submitted == [("0/2", A.label), ("1/2", B.label)]
    assert record["shards"] == {"0/2": A.label, "1/2": B.label}
    assert record["nodes"] == [A.label, B.label]


def test_a_shard_lost_with_its_node_reruns_on_the_other_node() -> None:
    c = ClusterParams(engine="ray", nodes=2)
    with pytest.MonkeyPatch.context() as mp:
        fake = FakeEngine(mp, {"0/2": [None, 0], "1/2": [0]})
        record = shards.run_shards("extract", "params.yaml", c)
    assert fake.submitted == [("0/2", A.label), ("1/2", B.label), ("0/2", B.label)]
    assert record["shards"] == {"0/2": B.label, "1/2": B.label}
    assert [a["rc"] for a in record["attempts"]] == [None, 0, 0]


def test_a_killed_worker_on_a_live_node_reruns_and_the_node_stays_usable() -> None:
    c = ClusterParams(engine="ray", nodes=2)
    with pytest.MonkeyPatch.context() as mp:
        fake = FakeEngine(mp, {"0/2": [-9, 0], "1/2": [0]})
        record = shards.run_shards("extract", "params.yaml", c)
    assert fake.submitted[2][0] == "0/2"
    assert set(record["shards"]) == {"0/2", "1/2"}


def test_a_failing_shard_stops_the_stage_naming_shard_and_node() -> None:
    c = ClusterParams(engine="ray", nodes=2)
    with pytest.MonkeyPatch.context() as mp:
        FakeEngine(mp, {"0/2": [2], "1/2": [0]})
        failed = r"extract shard 0/2 failed on 10\.0\.0\.1/a{8} \(exit 2\)"
        with pytest.raises(PipelineError, match=failed):
            shards.run_shards("extract", "params.yaml", c)


def test_a_shard_lost_max_attempts_times_is_refused() -> None:
    c = ClusterParams(engine="ray", nodes=2, max_attempts=2)
    with pytest.MonkeyPatch.context() as mp:
        FakeEngine(mp, {"0/2": [-9, -9], "1/2": [0]})
        with pytest.raises(PipelineError, match="lost 2 times"):
            shards.run_shards("extract", "params.yaml", c)


def test_no_node_left_is_refused_not_hung() -> None:
    c = ClusterParams(engine="ray", nodes=2)
    with pytest.MonkeyPatch.context() as mp:
        FakeEngine(mp, {"0/2": [None], "1/2": [None]})
        with pytest.raises(PipelineError, match="no node left"):
            shards.run_shards("extract", "params.yaml", c)
