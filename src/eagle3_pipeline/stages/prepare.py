"""Stage `prepare`: prompt files -> conversations with stable ids, split train/val by id hash.

Shapes, ids and row rules are conversations.py's; reading is prompt_files.py's. Rows stream: the
files are read batch by batch, sorted by id through runs on disk (external_sort.py), and written
as they come, so memory holds a batch, not the data set. Output: `train.jsonl` and `val.jsonl`
sorted by id, and `skipped.jsonl`, every row not used (file, line or row, reason). Rows with the
same id (equal conversations, for derived ids) are kept once; the others count as duplicates.

The split depends only on each id (not on file order or the number of prompts), so adding
prompts never moves an existing one between train and val.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from array import array
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import numpy as np

from eagle3_pipeline import atomic, conversations, external_sort, paths
from eagle3_pipeline.errors import DataError
from eagle3_pipeline.params import Params
from eagle3_pipeline.progress import log
from eagle3_pipeline.prompt_files import Where
from eagle3_pipeline.store import names

STAGE = "prepare"
OUTPUT_DIR = paths.PREPARED
SKIPPED = "skipped.jsonl"
SHOWN = 20  # rows named in one message; the count says how many more
LOG_EVERY_S = 10.0


def is_val(sample_id: str, val_ratio: float) -> bool:
    """Deterministic split: the id's hash, read as a fraction in [0, 1), below val_ratio."""
    digest = hashlib.sha256(sample_id.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < val_ratio


class SkipLog:
    """Rows not used: one line each in skipped.jsonl, counted by reason, the first SHOWN kept."""

    def __init__(self, fh: IO[str]) -> None:
        self.fh = fh
        self.counts: Counter[str] = Counter()
        self.first: list[str] = []

    def add(self, where: Where, reason: str, detail: str) -> None:
        self.counts[reason] += 1
        if len(self.first) < SHOWN:
            self.first.append(f"{where}: {detail}")
        rec = {"file": where.file, where.unit: where.n, "reason": reason, "detail": detail}
        self.fh.write(json.dumps(rec, sort_keys=True) + "\n")

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def summary(self) -> str:
        """`skipped 3: 2 empty, 1 assistant-first`."""
        by_reason = ", ".join(f"{n} {reason}" for reason, n in self.counts.most_common())
        return f"skipped {self.total}" + (f": {by_reason}" if by_reason else "")

    def listing(self) -> str:
        """The first SHOWN rows and how many more: one line, whatever the count."""
        more = self.total - len(self.first)
        return "; ".join(self.first) + (f"; ... and {more} more" if more > 0 else "")


def run(params: Params) -> None:
    p = params.prepare
    source = Path(p.prompts)
    scratch = paths.SCRATCH / STAGE
    scratch.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with (
        tempfile.TemporaryDirectory(prefix=".sort.", suffix=".tmp", dir=scratch) as sort_dir,
        atomic.replace_dir(OUTPUT_DIR) as tmp,
        open(tmp / SKIPPED, "w", encoding="utf-8") as skipped_fh,
        open(tmp / "train.jsonl", "w", encoding="utf-8") as train_fh,
        open(tmp / "val.jsonl", "w", encoding="utf-8") as val_fh,
    ):
        skipped = SkipLog(skipped_fh)
        read = _Reader(source, params, skipped)
        kept = n_val = capped = 0
        name_hashes = array("Q")
        prev: tuple[str, str] | None = None  # (id, where) of the last row written
        for sample_id, _, payload in external_sort.sorted_records(read.records(), Path(sort_dir)):
            meta, line = payload.split("\t", 1)
            where = Where(*json.loads(meta))
            if prev is not None and prev[0] == sample_id:
                skipped.add(where, "duplicate", _duplicate(sample_id, prev[1]))
                continue
            prev = (sample_id, str(where))
            if p.max_prompts and kept >= p.max_prompts:
                capped += 1
                continue
            kept += 1
            name_hashes.append(_hash64(names.sample_filename(sample_id)))
            val = is_val(sample_id, p.val_ratio)
            n_val += val
            (val_fh if val else train_fh).write(line + "\n")
        for fh in (skipped_fh, train_fh, val_fh):
            fh.flush()
            os.fsync(fh.fileno())
        seconds = max(time.monotonic() - t0, 1e-6)
        log(STAGE, f"read {read.rows} rows in {seconds:.1f} s ({read.rows / seconds:.0f} rows/s)")
        _check(source, p.on_unusable, read.rows, kept + capped, skipped)
        if kept == n_val:
            raise DataError(f"{source}: every prompt fell into val: lower prepare.val_ratio")
        _check_file_names(name_hashes, tmp, source)
        where_listed = f" (listed in {OUTPUT_DIR / SKIPPED})" if skipped.total else ""
        cap = f"; {capped} more left out by prepare.max_prompts" if capped else ""
        hint = ""
        if skipped.counts["trailing-assistant"]:
            hint = "; prepare.trailing_assistant: regenerate keeps rows that end with an answer"
        log(STAGE, f"kept {kept}, {skipped.summary()}{where_listed}{cap}{hint}")
    log(STAGE, f"{kept} conversations -> {kept - n_val} train, {n_val} val ({OUTPUT_DIR})")


class _Reader:
    """Every row of the prompt set as a sort record `(id, seq, "<where JSON>\\t<row JSON>")`;
    unusable rows go to the skip log. Logs its rate every LOG_EVERY_S seconds."""

    def __init__(self, source: Path, params: Params, skipped: SkipLog) -> None:
        self.source, self.params, self.skipped = source, params, skipped
        self.rows = 0

    def records(self) -> Iterator[external_sort.Record]:
        p = self.params.prepare
        t0 = last = time.monotonic()
        for where, row in conversations.read(self.source, p.trailing_assistant, p.id_field):
            self.rows += 1
            if self.rows % 1024 == 0 and (now := time.monotonic()) - last >= LOG_EVERY_S:
                last = now
                log(STAGE, f"read {self.rows} rows ({self.rows / (now - t0):.0f} rows/s)")
            if isinstance(row, conversations.Unusable):
                self.skipped.add(where, row.reason, row.detail)
                continue
            meta = json.dumps(list(where))
            yield row["id"], self.rows, f"{meta}\t{json.dumps(row, sort_keys=True)}"


def _duplicate(sample_id: str, first: str) -> str:
    if conversations.is_derived_id(sample_id):
        return f"the same conversation as {first} (id {sample_id})"
    return f"duplicate id {sample_id!r} (first in {first})"


def _check(source: Path, on_unusable: str, rows: int, usable: int, skipped: SkipLog) -> None:
    if rows == 0:
        raise DataError(
            f"{source}: prompt set is empty: add rows with messages "
            "(.jsonl, .json, .parquet; shapes: docs/data.md)"
        )
    if usable == 0:
        raise DataError(
            f"{source}: no usable row ({skipped.summary()}): {skipped.listing()}: fix the rows, "
            "or point prepare.prompts at another prompt set"
        )
    if skipped.total and on_unusable == "fail":
        raise DataError(
            f"{source}: {skipped.summary()} (prepare.on_unusable: fail): {skipped.listing()}: "
            "fix or remove those rows, or set prepare.on_unusable: skip"
        )


def _hash64(name: str) -> int:
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "big")


def _check_file_names(hashes: array, out_dir: Path, source: Path) -> None:
    """Two ids that would share a store file are refused (8 bytes a row in memory): the rare
    pair is found by a second pass over the written rows."""
    h = np.sort(np.frombuffer(hashes, dtype=np.uint64))
    clash = set(h[1:][h[1:] == h[:-1]].tolist())
    if not clash:
        return
    ids = []
    for split in ("train.jsonl", "val.jsonl"):
        with open(out_dir / split, encoding="utf-8") as fh:
            for line in fh:
                sid = json.loads(line)["id"]
                if _hash64(names.sample_filename(sid)) in clash:
                    ids.append(sid)
    names.check_unique(ids, str(source))
