"""Train across nodes, with a fake engine: the agents' commands, and what a lost node does."""

from __future__ import annotations

from collections import deque

import pytest

from eagle3_pipeline.cluster import engine, torchrun
from eagle3_pipeline.config.training_params import ClusterParams
from eagle3_pipeline.core.errors import PipelineError

A = engine.Node("a" * 56, "10.0.0.1")
B = engine.Node("b" * 56, "10.0.0.2")
C = engine.Node("c" * 56, "10.0.0.3")
ARGS = ["--worker", "/ws/data/.work/train/params.json"]


def test_agent_commands_share_one_rendezvous_hosted_on_the_first_node() -> None:
    cmd = torchrun.agent_command(
        nnodes=2, nproc=4, endpoint="10.0.0.1:29400", run_id="r1", is_host=True,
        local_addr="10.0.0.1", module="eagle3_pipeline.stages.train", args=ARGS,
    )  # fmt: skip
    assert cmd[1:] == [
        "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=4",
        "--rdzv-backend=c10d", "--rdzv-endpoint=10.0.0.1:29400", "--rdzv-id=r1",
        "--rdzv-conf=is_host=1", "--local-addr=10.0.0.1", "--max-restarts=0",
        "-m", "eagle3_pipeline.stages.train", *ARGS,
    ]  # fmt: skip
    other = torchrun.agent_command(
        nnodes=2, nproc=4, endpoint="10.0.0.1:29400", run_id="r1", is_host=False,
        local_addr="10.0.0.2", module="eagle3_pipeline.stages.train", args=ARGS,
    )  # fmt: skip
    assert "--rdzv-conf=is_host=0" in other and "--local-addr=10.0.0.2" in other


class FakeEngine:
    """Agents end in submission order with scripted exit codes per attempt (None: node lost)."""

    def __init__(self, mp: pytest.MonkeyPatch, script: list[dict], nodes=(A, B, C)):
        self.script = deque(script)  # per attempt: node label -> exit code
        self.nodes = list(nodes)
        self.dead: set[str] = set()
        self.submitted: list[list[tuple[str, list[str]]]] = []
        self.pending: deque = deque()
        self.cancelled: list = []
        mp.setattr(engine, "choose_nodes", self.choose)
        mp.setattr(engine, "alive_nodes", self.alive)
        mp.setattr(engine, "submit", self.submit)
        mp.setattr(engine, "outcome", self.outcome)
        mp.setattr(engine, "cancel", self.cancelled.extend)
        mp.setattr(torchrun, "_wait", lambda refs, timeout: [refs[0]] if refs else [])

    def alive(self) -> list[engine.Node]:
        return [n for n in self.nodes if n.node_id not in self.dead]

    def choose(self, c: ClusterParams, exclude=frozenset(), count=None) -> list[engine.Node]:
        nodes = [n for n in self.alive() if n.node_id not in exclude]
        if len(nodes) < count:
            raise PipelineError(f"cluster.train_nodes={count} but {len(nodes)} alive")
        self.codes = self.script.popleft()
        self.submitted.append([])
        return nodes[:count]

    def submit(self, node: engine.Node, argv: list[str], c: ClusterParams, env=None, **kw) -> tuple:
        assert kw == {"bind_collectives": True}  # every agent's gloo on its node's address
        self.submitted[-1].append((node.label, argv))
        return (len(self.submitted), node.label)

    def outcome(self, node: engine.Node, ref) -> engine.Outcome:
        if ref in self.cancelled:
            return engine.Outcome(node, None, "TaskCancelledError: cancelled")
        rc = self.codes[node.label]
        if rc is None:
            self.dead.add(node.node_id)
        return engine.Outcome(
            node, rc, "NodeDiedError: gone" if rc is None else "", node_died=rc is None
        )


def _run(c: ClusterParams, calls: list[int] | None = None) -> dict:
    return torchrun.run_across_nodes(
        c, 1, "eagle3_pipeline.stages.train", ARGS,
        before_attempt=(calls if calls is not None else []).append,
    )  # fmt: skip


def test_one_agent_per_node_and_the_record_names_them(monkeypatch: pytest.MonkeyPatch) -> None:
    c = ClusterParams(engine="ray", nodes=2, rdzv_port=29501)
    fake = FakeEngine(monkeypatch, [{A.label: 0, B.label: 0}])
    record = _run(c)
    (first, second), = fake.submitted  # fmt: skip
    assert [first[0], second[0]] == [A.label, B.label]
    assert "--rdzv-conf=is_host=1" in first[1] and "--rdzv-conf=is_host=0" in second[1]
    assert "--rdzv-endpoint=10.0.0.1:29501" in first[1] and "--nnodes=2" in second[1]
    assert record["nodes"] == [A.label, B.label] and record["rendezvous"] == A.label
    assert record["world_size"] == 2 and len(record["attempts"]) == 1


def test_a_lost_node_relaunches_on_alive_nodes_with_a_new_rendezvous(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    c = ClusterParams(engine="ray", nodes=2)
    # Attempt 1: B dies; A's agent fails on the broken collective (exit 1), not a failure of
    # its own. Attempt 2 runs on A and C.
    fake = FakeEngine(monkeypatch, [{A.label: 1, B.label: None}, {A.label: 0, C.label: 0}])
    calls: list[int] = []
    record = _run(c, calls)
    assert calls == [1, 2]  # the checkpoints were tidied before each attempt
    assert [label for label, _ in fake.submitted[1]] == [A.label, C.label]
    ids = [next(a for a in argv if a.startswith("--rdzv-id")) for _, argv in
           (fake.submitted[0][0], fake.submitted[1][0])]  # fmt: skip
    assert ids[0] != ids[1]
    assert record["nodes"] == [A.label, C.label]
    assert [a["attempt"] for a in record["attempts"]] == [1, 2]
    assert {x["node"]: x["rc"] for x in record["attempts"][0]["agents"]} == {
        A.label: 1, B.label: None,
    }  # fmt: skip


def test_a_node_ray_reports_dead_is_not_chosen_again_while_still_listed_alive(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Seen on a local cluster: NodeDiedError for B's agent while the GCS still listed B alive;
    attempt 2 chose B again and was lost at once (TaskUnschedulableError)."""

    class ListedLate(set):
        def add(self, node_id: str) -> None:  # the GCS has not marked it dead yet
            pass

    c = ClusterParams(engine="ray", nodes=2)
    fake = FakeEngine(monkeypatch, [{A.label: 1, B.label: None}, {A.label: 0, C.label: 0}])
    fake.dead = ListedLate()
    record = _run(c)
    assert [label for label, _ in fake.submitted[1]] == [A.label, C.label]
    assert len(record["attempts"]) == 2


def test_a_killed_agent_on_a_live_node_relaunches_there(monkeypatch: pytest.MonkeyPatch) -> None:
    c = ClusterParams(engine="ray", nodes=2)
    fake = FakeEngine(monkeypatch, [{A.label: 1, B.label: -9}, {A.label: 0, B.label: 0}])
    record = _run(c)
    assert [label for label, _ in fake.submitted[1]] == [A.label, B.label]
    assert len(record["attempts"]) == 2


def test_too_few_nodes_left_says_rerun_resumes(monkeypatch: pytest.MonkeyPatch) -> None:
    c = ClusterParams(engine="ray", nodes=2)
    FakeEngine(monkeypatch, [{A.label: 1, B.label: None}, {}], nodes=(A, B))
    with pytest.raises(PipelineError, match="too few are alive.*resumes from the last complete"):
        _run(c)


def test_a_failure_that_is_not_a_loss_raises_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    c = ClusterParams(engine="ray", nodes=2, max_attempts=3)
    fake = FakeEngine(monkeypatch, [{A.label: 0, B.label: 2}, {A.label: 0, B.label: 0}])
    with pytest.raises(PipelineError, match=r"agent on 10.0.0.2/bbbbbbbb failed \(exit 2\)"):
        _run(c)
    assert len(fake.submitted) == 1


def test_lost_every_attempt_stops_at_max_attempts(monkeypatch: pytest.MonkeyPatch) -> None:
    c = ClusterParams(engine="ray", nodes=2, max_attempts=2)
    lost = {A.label: 1, B.label: -9}
    fake = FakeEngine(monkeypatch, [lost, lost, lost])
    with pytest.raises(PipelineError, match="each of 2 attempts"):
        _run(c)
    assert len(fake.submitted) == 2


def test_agents_still_running_after_the_settle_window_are_cancelled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A's agent is killed; B's hangs (a dead peer need not close its sockets): B is cancelled
    once the settle window passed, and that cancellation is not B's loss."""
    c = ClusterParams(engine="ray", nodes=2)
    fake = FakeEngine(monkeypatch, [{A.label: -9}, {A.label: 0, B.label: 0}], nodes=(A, B))
    monkeypatch.setattr(torchrun, "SETTLE_S", 0.0)
    monkeypatch.setattr(
        torchrun, "_wait", lambda refs, timeout: [refs[0]] if timeout is None else []
    )
    record = _run(c)
    assert fake.cancelled == [(1, B.label)]
    assert [a["cancelled"] for a in record["attempts"][0]["agents"]] == [None, True]
    assert [label for label, _ in fake.submitted[1]] == [A.label, B.label]  # B still alive


def test_a_lost_inference_server_relaunches_on_the_same_nodes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Online mode: a rank's server died, so its agent failed (exit 1) with every training node
    alive; the attempt is lost with the server, not failed, and the next one runs (its agents
    get the servers left through env_for); without a lost server the same exit is a failure."""
    c = ClusterParams(engine="ray", nodes=2)
    FakeEngine(monkeypatch, [{A.label: 1, B.label: 0}, {A.label: 0, B.label: 0}])
    found = deque([["10.0.0.9/srv1"], []])
    record = torchrun.run_across_nodes(
        c, 1, "eagle3_pipeline.stages.train", ARGS, servers_lost=found.popleft
    )
    assert [a["attempt"] for a in record["attempts"]] == [1, 2]
    assert record["attempts"][0]["servers_lost"] == ["10.0.0.9/srv1"]
    assert "servers_lost" not in record["attempts"][1]

    FakeEngine(monkeypatch, [{A.label: 1, B.label: 0}])
    with pytest.raises(PipelineError, match="failed \\(exit 1\\)"):
        torchrun.run_across_nodes(c, 1, "eagle3_pipeline.stages.train", ARGS, servers_lost=list)


def test_each_rank_gets_its_share_of_the_node_s_cpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two local nodes of 1 CPU on one machine: 1 thread per rank, not every core each."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    big, small = engine.Node("d" * 56, "10.0.0.4", 96.0), engine.Node("e" * 56, "10.0.0.5", 1.0)
    assert torchrun.rank_threads(big, 8) == {"OMP_NUM_THREADS": "12"}
    assert torchrun.rank_threads(small, 2) == {"OMP_NUM_THREADS": "1"}
    assert torchrun.rank_threads(A, 1) == {}  # CPUs not known: left to torchrun
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert torchrun.rank_threads(big, 8) == {}  # the driver's own setting wins (passed as is)
