"""Resume state of long stages: a scratch folder per stage, an append-only journal, row keys.

Scratch folders (data/.work/<stage>/) are NOT DVC outputs (`persist: true` would make
DVC copy the whole output before each rerun); finished work moves into the output by rename.
A scratch folder remembers the fingerprint it was made for and is wiped when it changes, so a
resumed run never mixes rows made under other params. Stages whose data grows by rows
(synthesize, generate, tokenize, extract) key their scratch folder on their settings only, not
on their input files, and key each row by its own inputs as well (`row_key`): rows added to the
inputs leave the journal of the others usable.

Each batch of finished rows is appended and fsynced; a kill can only lose the batch in flight.
A torn last line (killed mid-write) is ignored on reading and cut off before the next append.
An append that fails (disk full, I/O error) ends the stage at once with the OS's reason, the
mount and its free space (disk.DiskError); the rows journaled before it are kept for the rerun.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

from eagle3_pipeline.core import disk, paths


class Journal:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def read(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        rows, good_bytes = [], 0
        with open(self.path, "rb") as fh:
            for line in fh:
                if not line.endswith(b"\n"):
                    break
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    break
                good_bytes += len(line)
        if good_bytes != self.path.stat().st_size:
            os.truncate(self.path, good_bytes)
        return rows

    def append(self, rows: list[dict[str, Any]]) -> None:
        if not rows:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        data = "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows).encode()
        with disk.guard(self.path.parent.name, self.path), open(self.path, "ab") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())

    def clear(self) -> None:
        self.path.unlink(missing_ok=True)


SCRATCH_ROOT = paths.SCRATCH


def files_stamp(path: str | Path) -> str:
    """Cheap stamp of a folder's files (name, size, mtime): changes when the files change.

    A run keyed on it (train's `init_from` drafter) starts over when other weights sit at the
    same path. Never hashes contents: 547 GB for Kimi-K2.5's verifier, whose rows are keyed on
    verifier/identity.content_stamp instead (the same on every machine).
    """
    parts = sorted(
        (f.name, f.stat().st_size, f.stat().st_mtime_ns)
        for f in Path(path).iterdir()
        if f.is_file()
    )
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()


def fingerprint(*parts: Any) -> str:
    """Hash of JSON-serialisable inputs (params sections, input file hashes)."""
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()


def row_key(settings: str, content: Any) -> str:
    """The key of one row: its own inputs (`content`, JSON-serialisable) under the stage's
    settings key (the params, verifier and row-code version that decide every row's output).
    Equal keys, equal rows: a stage reuses a row made before whose key it finds."""
    return fingerprint(settings, content)


def scratch_dir(stage: str, key: str) -> Path:
    """data/.work/<stage>/, emptied first when it was made for another fingerprint `key`."""
    path = SCRATCH_ROOT / stage
    marker = path / "fingerprint.txt"
    if path.exists() and (not marker.exists() or marker.read_text() != key):
        shutil.rmtree(path)
    path.mkdir(parents=True, exist_ok=True)
    if not marker.exists():
        marker.write_text(key)
    return path


def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
