"""Write files and directories so that a reader never sees a half-written one.

With DVC's hardlink/symlink cache, workspace outputs ARE the cache: a file must never be modified
in place. Everything here writes a new file under a temp name, fsyncs it, then renames it.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any


def fsync_dir(path: Path) -> None:
    """Make a rename in `path` durable (the directory entry, not only the file's bytes)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str | Path, write: Callable[[Path], None], fsync: bool = True) -> Path:
    """Call `write(tmp_path)`, then rename tmp_path to `path` (same directory, same filesystem)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        write(tmp_path)
        if fsync:
            with open(tmp_path, "rb+") as fh:
                os.fsync(fh.fileno())
        os.replace(tmp_path, path)
        if fsync:
            fsync_dir(path.parent)
    except BaseException:
        tmp_path.unlink(missing_ok=True)
        raise
    return path


def write_bytes(path: str | Path, data: bytes) -> Path:
    return atomic_write(path, lambda p: p.write_bytes(data))


def write_text(path: str | Path, text: str) -> Path:
    return atomic_write(path, lambda p: p.write_text(text))


def write_json(path: str | Path, obj: Any, sort_keys: bool = True) -> Path:
    """`sort_keys` False: the order the writer chose (a metrics file that leads with its
    headline)."""
    return write_text(path, json.dumps(obj, indent=2, sort_keys=sort_keys) + "\n")


def write_jsonl(path: str | Path, rows: list[dict[str, Any]]) -> Path:
    return write_text(path, "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))


@contextlib.contextmanager
def replace_dir(path: str | Path) -> Iterator[Path]:
    """Yield a fresh temp directory beside `path`; on success it replaces `path` whole."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; outputs are shared with teammates
    try:
        yield tmp
        old = None
        if path.exists() or path.is_symlink():
            old = path.with_name(f".{path.name}.old-{os.getpid()}")
            os.replace(path, old)
        os.replace(tmp, path)
        if old is not None:
            if old.is_dir() and not old.is_symlink():
                shutil.rmtree(old)
            else:
                old.unlink()
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def link_or_copy(src: Path, dst: Path, link: bool = True) -> None:
    """Put `src`'s bytes at `dst` (a new name): a hardlink, or across filesystems (or with
    `link` false) a copy.

    A copy (scratch on local NVMe, outputs on shared storage) is fsynced before it counts; the
    caller publishes `dst`'s directory whole (replace_dir), so a torn copy is never visible.
    """
    if link:
        try:
            os.link(src, dst)
            return
        except OSError as exc:
            if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EOPNOTSUPP, errno.EMLINK):
                raise
    shutil.copyfile(src, dst)
    with open(dst, "rb+") as fh:
        os.fsync(fh.fileno())


def temp_names(path: str | Path) -> list[Path]:
    """What a killed atomic_write or replace_dir of `path` left beside it."""
    path = Path(path)
    if not path.parent.is_dir():
        return []
    return sorted(
        [*path.parent.glob(f".{path.name}.*.tmp"), *path.parent.glob(f".{path.name}.old-*")]
    )


def sweep_temps(path: str | Path) -> list[Path]:
    """Remove what a killed write of `path` left (only the caller's own outputs: the caller holds
    the stage's lock, so no live writer owns them). Returns what was removed."""
    removed = temp_names(path)
    for p in removed:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
    return removed
