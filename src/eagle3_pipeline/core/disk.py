"""Disk faults said in the user's terms: which filesystem, how much is free, how much is needed.

A write that fails (disk full, quota, I/O error, read-only remount) must end the stage at once
with the OS's reason, not surface later as a timeout or a torn file. `guard` turns such a
failure into one DiskError line; `layout` tells whether scratch and output share a filesystem
(a publish by rename or hardlink) or not (a publish by copy).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

from eagle3_pipeline.core.errors import DiskError

# Errors that mean "this filesystem cannot take the write", whatever wrote it.
WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS, errno.EFBIG}
# torch.save reports a failed write as a RuntimeError from its C++ zip writer, without the errno
# (on a full tmpfs: "[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534").
_TORCH_WRITE_FAILED = ("PytorchStreamWriter", "file write failed", "unexpected pos")
_OS_ERROR = re.compile(r"\(os error (\d+)\)")


def existing(path: str | Path) -> Path:
    """`path` or its nearest existing parent (a folder not made yet lives on its parent's disk)."""
    p = Path(os.path.abspath(path))
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def mount_of(path: str | Path) -> tuple[str, str, str]:
    """(mount point, filesystem type, device) of the filesystem holding `path`."""
    p = existing(path).resolve()
    while not os.path.ismount(p) and p != p.parent:
        p = p.parent
    fstype = device = "?"
    with contextlib.suppress(OSError):
        for line in Path("/proc/mounts").read_text().splitlines():
            dev, point, kind = line.split()[:3]
            if point.replace("\\040", " ") == str(p):
                device, fstype = dev, kind  # the last entry wins (mounts stack)
    return str(p), fstype, device


def gb(n: float) -> str:
    return f"{n / 1e6:,.3f} MB" if n < 1e9 else f"{n / 1e9:,.1f} GB"


def describe(path: str | Path) -> str:
    """`mount /x (tmpfs on tmpfs): 0.004 MB free of 2.097 MB`."""
    point, fstype, device = mount_of(path)
    usage = shutil.disk_usage(existing(path))
    return f"mount {point} ({fstype} on {device}): {gb(usage.free)} free of {gb(usage.total)}"


def same_filesystem(a: str | Path, b: str | Path) -> bool:
    return existing(a).stat().st_dev == existing(b).stat().st_dev


def errno_of(exc: BaseException) -> int | None:
    """The OS error number of `exc`, also where a library kept only its text (safetensors:
    `SafetensorError: Error while serializing: I/O error: ... (os error 28)`)."""
    if isinstance(exc, OSError):
        return exc.errno
    found = _OS_ERROR.search(str(exc))
    return int(found.group(1)) if found else None


def is_write_failure(exc: BaseException) -> bool:
    if errno_of(exc) in WRITE_ERRNOS:
        return True
    return isinstance(exc, RuntimeError) and any(s in str(exc) for s in _TORCH_WRITE_FAILED)


def os_reason(exc: BaseException) -> str:
    code = errno_of(exc)
    if code is not None:
        strerror = exc.strerror if isinstance(exc, OSError) else None
        return f"[Errno {code}] {strerror or os.strerror(code)}"
    return f"torch could not write the file ({str(exc).splitlines()[0][:120]})"


def write_failure(
    stage: str, exc: BaseException, path: str | Path, need_bytes: float | None = None
) -> DiskError:
    """The one line for a failed write: what, why (the OS), where (mount, free), what it needs."""
    target = getattr(exc, "filename", None) or path
    need = f"; about {gb(need_bytes)} still to write" if need_bytes else ""
    return DiskError(
        f"{stage}: writing {target} failed: {os_reason(exc)}; {describe(target)}{need}: free space "
        f"(or move that folder to a larger disk) and rerun: finished work is kept and resumed"
    )


@contextlib.contextmanager
def guard(
    stage: str, path: str | Path, need_bytes: Callable[[], float | None] | None = None
) -> Iterator[None]:
    """Turn a failed write inside the block into a DiskError about `path`'s filesystem."""
    try:
        yield
    except DiskError:
        raise
    except Exception as exc:
        if not is_write_failure(exc):
            raise
        raise write_failure(stage, exc, path, need_bytes() if need_bytes else None) from exc


def layout(scratch: str | Path, output: str | Path) -> str:
    """One line: do scratch and output share a filesystem (publish links) or not (copies)?"""
    if same_filesystem(scratch, output):
        return f"scratch {scratch} and output {output} on one filesystem: publish by hardlink"
    return (
        f"scratch {scratch} ({mount_of(scratch)[0]}) and output {output} "
        f"({mount_of(output)[0]}) on different filesystems: publish copies and fsyncs every file"
    )
