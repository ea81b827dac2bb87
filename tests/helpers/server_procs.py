"""Find the vLLM servers a test started: by a tag in their environment (also once re-parented),
or by the port on their command line; and the run's API key a server holds."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

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


def server_pids(port: int) -> list[int]:
    """The watchdog and vLLM processes of the server on `port` (its command line names it)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                argv = (entry / "cmdline").read_bytes().split(b"\0")
                if b"eagle3_pipeline.serving.server_entry" in argv and str(port).encode() in argv:
                    found.append(int(entry.name))
    return found


def server_key(pid: int) -> str:
    """The API key a server process holds (its VLLM_API_KEY: never on its command line)."""
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return next(v for v in environ if v.startswith(b"VLLM_API_KEY=")).split(b"=", 1)[1].decode()
