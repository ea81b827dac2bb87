"""Find the vLLM servers a test started: by a tag in their environment (also once re-parented),
or by the port they listen on (the kernel's pick: `--port 0` on their command line); and the
run's API key a server holds."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

import psutil

from eagle3_pipeline.in_vllm import entry_points

TAG_VAR = "EAGLE3_TEST_SERVER_TAG"


def tagged_pids(tag: str) -> list[int]:
    """Live processes whose environment carries `tag`."""
    needle = f"{TAG_VAR}={tag}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                pids.append(int(entry.name))
    return pids


def wait_none_tagged(tag: str, timeout_s: float = 60.0) -> list[int]:
    """The tagged processes still alive after waiting up to timeout_s for them to end."""
    deadline = time.monotonic() + timeout_s
    while (left := tagged_pids(tag)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def _listens(pid: int, port: int) -> bool:
    """Whether process `pid` holds a socket listening on TCP `port`, any address, in its own
    network namespace (/proc/PID/net/tcp: a cluster node's namespace, not this process's)."""
    try:
        inodes = {
            os.readlink(fd)[8:-1]
            for fd in Path(f"/proc/{pid}/fd").iterdir()
            if os.readlink(fd).startswith("socket:[")
        }
        tables = [Path(f"/proc/{pid}/net/{t}").read_text() for t in ("tcp", "tcp6")]
    except OSError:
        return False
    for line in "".join(t.split("\n", 1)[1] for t in tables).splitlines():
        cols = line.split()  # sl local_address rem_address st ... inode (column 9)
        if cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port and cols[9] in inodes:
            return True
    return False


def server_pids(port: int) -> list[int]:
    """The watchdog and vLLM processes of the server listening on `port`: the ones that listen
    on it (the API server, and the engine core it forked), their watchdog, which names `--port
    0`, and a server started on a port asked for, whose command line names it."""
    entries: dict[int, list[bytes]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                argv = (entry / "cmdline").read_bytes().split(b"\0")
                if entry_points.SERVER_ENTRY.encode() in argv:
                    entries[int(entry.name)] = argv
    found = {pid for pid, argv in entries.items() if str(port).encode() in argv}
    found |= {pid for pid in entries if _listens(pid, port)}
    for pid in list(found):
        with contextlib.suppress(psutil.NoSuchProcess):
            if (parent := psutil.Process(pid).ppid()) in entries:
                found.add(parent)
    return sorted(found)


def server_key(pid: int) -> str:
    """The API key a server process holds (its VLLM_API_KEY: never on its command line)."""
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return next(v for v in environ if v.startswith(b"VLLM_API_KEY=")).split(b"=", 1)[1].decode()
