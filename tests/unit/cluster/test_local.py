"""`make cluster-local`'s start order and its failures, with a stand-in `ray` executable: the head
first, the other nodes together once the head listens; a node that exits is named with its log,
and what started is stopped (no state file, no process left)."""

from __future__ import annotations

import socket
import sys
import textwrap
from pathlib import Path

import pytest

from eagle3_pipeline.cluster import local
from eagle3_pipeline.core.errors import PipelineError

FAKE_RAY = """\
#!{python}
import os, socket, sys, time
from pathlib import Path
args = sys.argv[1:]
head = "--head" in args
log = Path({events!r})
with log.open("a") as f:
    f.write(("head" if head else "worker") + " " + str(os.getpid()) + "\\n")
if not head and {worker_exit} is not None:
    sys.exit({worker_exit})
if head:
    if {head_exit} is not None:
        sys.exit({head_exit})
    time.sleep({head_delay})
    port = int(next(a for a in args if a.startswith("--port=")).split("=")[1])
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", port))
    s.listen()
    with log.open("a") as f:
        f.write("listening " + str(os.getpid()) + "\\n")
time.sleep(60)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def fake_ray(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    def make(head_exit=None, worker_exit=None, head_delay=0.5, alive=lambda: 0) -> Path:
        events = tmp_path / "events.txt"
        script = tmp_path / "ray"
        script.write_text(
            textwrap.dedent(FAKE_RAY).format(
                python=sys.executable, events=str(events), head_exit=head_exit,
                worker_exit=worker_exit, head_delay=head_delay,
            )
        )  # fmt: skip
        script.chmod(0o755)
        monkeypatch.setattr(local, "_ray_bin", lambda: str(script))
        monkeypatch.setattr(local, "_alive_nodes", lambda address, env: alive())
        monkeypatch.setattr(local, "START_TIMEOUT_S", 10.0)
        return events

    return make


def _gone(state: Path, pids: list[int]) -> None:
    assert not state.exists()
    for pid in pids:
        assert not local._alive(pid), pid


def test_workers_start_together_once_the_head_listens(fake_ray, tmp_path: Path, capsys) -> None:
    joined = tmp_path / "events.txt"  # a node is alive once its process wrote its line
    events = fake_ray(
        alive=lambda: joined.read_text().count("head") + joined.read_text().count("worker")
    )
    state = tmp_path / "cluster/local.json"
    record = local.up(3, port=_free_port(), state=state)
    try:
        lines = events.read_text().split("\n")
        kinds = [line.split()[0] for line in lines if line]
        assert kinds[:2] == ["head", "listening"] and sorted(kinds[2:]) == ["worker", "worker"]
        assert len(record["nodes"]) == 3
        out = capsys.readouterr().out
        assert "node 0 up (head)" in out and "node 2 up (joined 127.0.0.1:" in out
    finally:
        pids = [n["pid"] for n in record["nodes"]]
        assert local.down(state) >= 3
    _gone(state, pids)


def test_a_head_that_exits_is_named_with_its_log(fake_ray, tmp_path: Path) -> None:
    fake_ray(head_exit=3)
    state = tmp_path / "cluster/local.json"
    with pytest.raises(PipelineError, match=r"node 0 exited \(3\): see .*node-0\.log"):
        local.up(2, port=_free_port(), state=state)
    assert not state.exists()


def test_a_worker_that_exits_is_named_and_the_head_stopped(fake_ray, tmp_path: Path) -> None:
    events = fake_ray(worker_exit=5, alive=lambda: 1)
    state = tmp_path / "cluster/local.json"
    with pytest.raises(PipelineError, match=r"node 1 exited \(5\): see .*node-1\.log"):
        local.up(2, port=_free_port(), state=state)
    assert not state.exists()
    head = next(line.split()[1] for line in events.read_text().splitlines() if "listening" in line)
    _gone(state, [int(head)])  # the head had started and listened: `down` stopped it


def test_nodes_that_never_join_are_refused_in_time(fake_ray, tmp_path: Path, monkeypatch) -> None:
    fake_ray(alive=lambda: 1)
    monkeypatch.setattr(local, "START_TIMEOUT_S", 2.0)
    state = tmp_path / "cluster/local.json"
    with pytest.raises(PipelineError, match=r"not all 2 nodes joined in 2 s: see .*node-1\.log"):
        local.up(2, port=_free_port(), state=state)
    assert not state.exists()
