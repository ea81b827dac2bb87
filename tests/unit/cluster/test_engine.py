"""The body of a cluster worker (engine._run_command), run here without Ray: the command gets the
driver's environment, not the OMP_NUM_THREADS Ray sets in a worker; with a bind address, gloo's
interface (and NCCL's) is the one holding it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from eagle3_pipeline.cluster import engine


def _run(
    tmp_path: Path, passed: dict[str, str], names=("OMP_NUM_THREADS", "HF_X"), bind=None
) -> str:
    out = tmp_path / "out.txt"
    code = (
        "import os; e = os.environ.get; "
        f"print(*map(e, {list(names)!r}), file=open({str(out)!r}, 'w'))"
    )
    argv = [sys.executable, "-c", code]
    result = engine._run_command(argv, str(tmp_path), passed, bind)
    assert result["rc"] == 0 and 0 < result["command_s"] < 60  # the work, for the bench
    return out.read_text().strip()


def test_ray_s_omp_num_threads_does_not_reach_the_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # what Ray sets in a 1-CPU worker
    assert _run(tmp_path, {"HF_X": "y"}) == "None y"


def test_the_driver_s_own_omp_num_threads_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert _run(tmp_path, {"OMP_NUM_THREADS": "3"}) == "3 None"


def test_gloo_and_nccl_bind_the_interface_that_holds_the_node_s_address(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    both = ["GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"]
    for name in both:
        monkeypatch.delenv(name, raising=False)
    loopback = engine.interface_of("127.0.0.1")
    assert loopback is not None and loopback.startswith("lo")
    assert _run(tmp_path, {}, both, "127.0.0.1") == f"{loopback} {loopback}"
    assert _run(tmp_path, {}, both, None) == "None None"  # not asked: unset
    assert engine.interface_of("203.0.113.77") is None  # no interface: left to gloo and NCCL
    assert _run(tmp_path, {}, both, "203.0.113.77") == "None None"
    # the user's choice wins, each variable on its own
    assert _run(tmp_path, {"GLOO_SOCKET_IFNAME": "eth9"}, both, "127.0.0.1") == f"eth9 {loopback}"
    assert _run(tmp_path, {"NCCL_SOCKET_IFNAME": "ib0"}, both, "127.0.0.1") == f"{loopback} ib0"


@pytest.mark.parametrize(
    ("error", "node_died"),
    [
        (lambda e: e.NodeDiedError("node 10.0.0.2 died"), True),
        (lambda e: e.TaskUnschedulableError("no node with that id"), True),
        (lambda e: e.WorkerCrashedError(), False),  # the process, not the node
        (lambda e: e.TaskCancelledError(), False),
    ],
)
def test_a_lost_worker_is_classified_by_ray_s_error_type(
    error, node_died: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ray

    exc = error(ray.exceptions)

    def get(ref):
        raise exc

    monkeypatch.setattr(ray, "get", get)
    node = engine.Node("abcdef0123", "10.0.0.2")
    lost = engine.outcome(node, object())
    assert lost.rc is None and lost.lost and lost.node_died is node_died
    assert lost.error.startswith(type(exc).__name__)
