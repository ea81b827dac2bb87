"""A Mooncake master on loopback for tests: free ports, bounded waits, always stopped.

`mooncake_master` (the mooncake-transfer-engine-non-cuda wheel's console script; it execs the
binary, so the pid is the master's) binds its RPC and metrics servers to 0.0.0.0 and fixed ports
by default: both are set here to 127.0.0.1 and ports the kernel hands out.
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
from dataclasses import dataclass
from pathlib import Path

HOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def master_binary() -> Path:
    """The venv's `mooncake_master` (beside this Python)."""
    return Path(sys.executable).parent / "mooncake_master"


@dataclass(frozen=True)
class Master:
    address: str  # host:port, what clients take as `master_server_address`
    pid: int
    log: Path


def _log_tail(log: Path, lines: int = 20) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    return ""


@contextlib.contextmanager
def loopback_master(workdir: Path, ready_timeout_s: float = 20.0) -> Iterator[Master]:
    """A running master on 127.0.0.1 until the block ends; its log is `workdir/master.log`."""
    workdir.mkdir(parents=True, exist_ok=True)
    log = workdir / "master.log"
    rpc_port = free_port()
    cmd = [
        str(master_binary()),
        f"--rpc_address={HOST}",
        f"--rpc_port={rpc_port}",
        f"--metrics_host={HOST}",
        f"--metrics_port={free_port()}",
        "--logtostderr",
    ]
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + ready_timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"mooncake_master exited {proc.returncode}:\n{_log_tail(log)}")
            with contextlib.suppress(OSError), socket.create_connection((HOST, rpc_port), 0.5):
                break
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"mooncake_master not listening on {HOST}:{rpc_port} after "
                    f"{ready_timeout_s:.0f} s:\n{_log_tail(log)}"
                )
            time.sleep(0.05)
        yield Master(f"{HOST}:{rpc_port}", proc.pid, log)
    finally:
        stop(proc)


def stop(proc: subprocess.Popen, timeout_s: float = 10.0) -> None:
    """SIGTERM to the process group, SIGKILL after timeout_s; returns once it is gone."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout_s)
