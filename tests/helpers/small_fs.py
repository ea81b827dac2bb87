"""A small real filesystem for fault tests: a tmpfs mounted where the test needs a full disk.

Mounting needs root (CI runs as root). Where it is refused, `small_tmpfs` yields False and the
test injects the same OS error instead, so every fault test runs everywhere.
"""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path


def mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
        capture_output=True,
        check=False,
    )
    return done.returncode == 0


def resize(path: Path, size: str) -> None:
    subprocess.run(["mount", "-o", f"remount,size={size}", str(path)], check=True)


@contextlib.contextmanager
def small_tmpfs(path: Path, size: str) -> Iterator[bool]:
    """Mount a tmpfs of `size` at `path` for the block; False when this machine refuses."""
    mounted = mount_tmpfs(path, size)
    try:
        yield mounted
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(path)], check=False)


def enospc(path: str | Path = "") -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path) or None)
