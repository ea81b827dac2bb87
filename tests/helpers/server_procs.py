"""Find the vLLM servers a test started, by a tag in their environment (also once re-parented)."""

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
