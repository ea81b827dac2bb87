"""Sort more records than memory holds: sorted runs on disk, merged lazily (heapq.merge).

Records are `(key, seq, payload)`, sorted by `(key, seq)`; `payload` is one line of text (no
newline). Memory holds one run (about `run_bytes` of payloads); a set that fits in one run never
touches the disk.
"""

from __future__ import annotations

import heapq
import json
from collections.abc import Iterable, Iterator
from pathlib import Path

Record = tuple[str, int, str]
RUN_BYTES = 64 << 20


def sorted_records(
    records: Iterable[Record], scratch: Path, run_bytes: int = RUN_BYTES
) -> Iterator[Record]:
    """`records` sorted by (key, seq); runs go to files in `scratch` (the caller removes it)."""
    runs: list[Path] = []
    buf: list[Record] = []
    size = 0
    for rec in records:
        buf.append(rec)
        size += len(rec[2]) + len(rec[0]) + 64
        if size >= run_bytes:
            runs.append(_write_run(sorted(buf), scratch / f"run-{len(runs):05d}"))
            buf, size = [], 0
    buf.sort()
    if not runs:
        yield from buf
        return
    if buf:
        runs.append(_write_run(buf, scratch / f"run-{len(runs):05d}"))
    del buf
    handles = [open(r, encoding="utf-8") for r in runs]  # noqa: SIM115 (closed below)
    try:
        yield from heapq.merge(*(_read_run(h) for h in handles))
    finally:
        for h in handles:
            h.close()


def _write_run(records: list[Record], path: Path) -> Path:
    with open(path, "w", encoding="utf-8") as fh:
        for key, seq, payload in records:
            fh.write(f"{json.dumps([key, seq])}\t{payload}\n")
    return path


def _read_run(fh) -> Iterator[Record]:
    for line in fh:
        head, payload = line.rstrip("\n").split("\t", 1)
        key, seq = json.loads(head)
        yield key, seq, payload
