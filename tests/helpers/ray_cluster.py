"""A real local Ray cluster for a test workspace, and a node lost on purpose.

The cluster is the project's own (`python -m eagle3_pipeline.cluster.local up`), started in the
workspace so that its state and token stay there, always stopped by the context manager. Where
addresses matter, each node but the head gets its own network namespace and address (`--netns`,
which needs root: as root the tests always use it; otherwise the nodes share this address).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from eagle3_pipeline.cluster.local import read_state

REPO = Path(__file__).resolve().parents[2]


def env(site: Path | None = None) -> dict[str, str]:
    """The workspace runs this repo's code (not the editable install's), plus an optional site."""
    out = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", HF_HUB_OFFLINE="1")
    out["PYTHONPATH"] = os.pathsep.join(str(p) for p in (site, REPO / "src") if p)
    return out


def free_port(lo: int, hi: int) -> int:
    for port in range(lo, hi):
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) != 0:
                return port
    raise RuntimeError(f"no free port in {lo}-{hi}")


NETNS = os.geteuid() == 0  # network namespaces need CAP_NET_ADMIN


@contextlib.contextmanager
def local_cluster(
    workdir: Path,
    nodes: int = 2,
    ports: tuple[int, int] = (6390, 6400),
    netns: bool = False,
) -> Iterator[dict]:
    """`nodes` Ray nodes started from `workdir`; yields its state record; stops them after.
    `netns`: distinct addresses (when this process may make namespaces: NETNS)."""
    cmd = [sys.executable, "-m", "eagle3_pipeline.cluster.local"]
    port = free_port(*ports)
    flags = ["--netns"] if netns and NETNS else []
    try:
        subprocess.run(
            [*cmd, "up", "--nodes", str(nodes), "--port", str(port), *flags],
            cwd=workdir,
            env=env(),
            check=True,
            timeout=300,
        )
        yield read_state(workdir / "data/.work/cluster/local.json")
    finally:
        subprocess.run([*cmd, "down"], cwd=workdir, env=env(), timeout=120)


def processes(pattern: str) -> list[tuple[int, int, str]]:
    """(pid, session id, command line) of every process whose command line contains `pattern`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            argv = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            if pattern in argv and int(entry.name) != os.getpid():  # not this test's process
                found.append((int(entry.name), os.getsid(int(entry.name)), argv))
    return found


def kill_session(sid: int) -> int:
    """SIGKILL every process of a node's session: the node is lost, as a machine that dies."""
    pids = [pid for pid, s, _ in processes("") if s == sid]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return len(pids)


def kill_worker_node(state: dict, pattern: str, ready, timeout_s: float = 300) -> str | None:
    """Once a process matching `pattern` runs on a worker node (not the head: the GCS lives
    there) and `ready(command line)` holds, kill that whole node. Returns the killed process's
    command line, or None when that did not happen within timeout_s."""
    head_sid = state["nodes"][0]["pid"]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for _pid, sid, argv in processes(pattern):
            if sid != head_sid and ready(argv):
                kill_session(sid)
                return argv
        time.sleep(0.05)
    return None
