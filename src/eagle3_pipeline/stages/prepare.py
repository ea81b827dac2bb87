"""Stage `prepare`: prompt files -> conversations with stable ids, split train/val by id hash.

Shapes, ids and row rules are formats.py's; reading is prompt_files.py's. Rows stream: the
files are read batch by batch, sorted by id through runs on disk (external_sort.py), and written
as they come, so memory holds a batch, not the data set. Output: `train.jsonl` and `val.jsonl`
sorted by id, and `skipped.jsonl`, every row not used (file, line or row, reason). Rows with the
same id (equal conversations, for derived ids) are kept once; the others count as duplicates.

The split depends only on each id (not on file order or the number of prompts), so adding
prompts never moves an existing one between train and val.

Prompts the verifier wrote (the synthesize stage, prepare.synthesize.count > 0) are a second
source, data/synthesized/prompts.jsonl, read after the given files (a row in both is kept as
given). prepare.synthesized_share null takes every row of both; a share s takes the largest
mix with s of it synthesized that the two sources allow, each source's rows in the order of a
hash of their ids (another hash than the split's), so a smaller mix is nested in a larger one;
with s = 1.0 the given files are not read. With count 0 the synthesized source is not read.
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

from eagle3_pipeline.config.params import Params, PrepareParams
from eagle3_pipeline.conversations import formats
from eagle3_pipeline.conversations.prompt_files import Where
from eagle3_pipeline.conversations.synthesis_mix import mix_counts
from eagle3_pipeline.core import atomic, external_sort, paths, readers
from eagle3_pipeline.core.errors import DataError, ParamsError
from eagle3_pipeline.core.progress import log
from eagle3_pipeline.store import names

STAGE = "prepare"
OUTPUT_DIR = paths.PREPARED
SKIPPED = "skipped.jsonl"
SHOWN = 20  # rows named in one message; the count says how many more
LOG_EVERY_S = 10.0
SYNTHESIZED = paths.SYNTHESIZED / "prompts.jsonl"  # the synthesize stage's (stages/synthesize.py)
SYNTHESIZED_STATS = paths.SYNTHESIZED / "stats.json"


def is_val(sample_id: str, val_ratio: float) -> bool:
    """Deterministic split: the id's hash, read as a fraction in [0, 1), below val_ratio."""
    digest = hashlib.sha256(sample_id.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < val_ratio


def mix_rank(sample_id: str) -> int:
    """The order in which a source's rows are taken into a mix: a hash of the id, salted so
    that it is independent of the split's (the first rows taken are not all val rows)."""
    return int.from_bytes(hashlib.sha256(b"mix\0" + sample_id.encode()).digest()[:8], "big")


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
    synthesized = _synthesized_source(p)
    share = p.synthesized_share
    named = SYNTHESIZED if share == 1.0 else source  # the set errors name
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
        read = _Reader(source if share != 1.0 else None, params, skipped, synthesized)
        records = external_sort.sorted_records(read.records(), Path(sort_dir))
        rows = _unique(records, skipped)
        mix = _Mix(share, Path(sort_dir)) if share is not None else None
        if mix is not None:
            rows = mix.select(rows)
        kept = n_val = capped = n_synthesized = 0
        name_hashes = array("Q")
        for sample_id, line, is_synthesized in rows:
            if p.max_prompts and kept >= p.max_prompts:
                capped += 1
                continue
            kept += 1
            n_synthesized += is_synthesized
            name_hashes.append(_hash64(names.sample_filename(sample_id)))
            val = is_val(sample_id, p.val_ratio)
            n_val += val
            (val_fh if val else train_fh).write(line + "\n")
        for fh in (skipped_fh, train_fh, val_fh):
            fh.flush()
            os.fsync(fh.fileno())
        seconds = max(time.monotonic() - t0, 1e-6)
        log(STAGE, f"read {read.rows} rows in {seconds:.1f} s ({read.rows / seconds:.0f} rows/s)")
        left_out = mix.left_out if mix is not None else 0
        _check(named, p.on_unusable, read.rows, kept + capped + left_out, skipped)
        if mix is not None and kept + capped == 0:
            raise DataError(mix.nothing_taken(source))
        if kept == n_val:
            raise DataError(f"{named}: every prompt fell into val: lower prepare.val_ratio")
        _check_file_names(name_hashes, tmp, named)
        where_listed = f" (listed in {OUTPUT_DIR / SKIPPED})" if skipped.total else ""
        cap = f"; {capped} more left out by prepare.max_prompts" if capped else ""
        hint = ""
        if skipped.counts["trailing-assistant"]:
            hint = "; prepare.trailing_assistant: regenerate keeps rows that end with an answer"
        log(STAGE, f"kept {kept}, {skipped.summary()}{where_listed}{cap}{hint}")
        if synthesized is not None:
            how = mix.how() if mix is not None else "prepare.synthesized_share null: all of both"
            log(STAGE, f"{n_synthesized} synthesized + {kept - n_synthesized} given ({how})")
    log(STAGE, f"{kept} conversations -> {kept - n_val} train, {n_val} val ({OUTPUT_DIR})")


def _synthesized_source(p: PrepareParams) -> Path | None:
    """The synthesize stage's prompts when prepare.synthesize.count asks for some, else None."""
    if p.synthesize.count == 0:
        if p.synthesized_share is not None:
            raise ParamsError(
                f"prepare.synthesized_share is {p.synthesized_share:g} but "
                "prepare.synthesize.count is 0 (no synthesized prompts to mix): set a count, or "
                "prepare.synthesized_share: null"
            )
        return None
    fix = "run the synthesize stage first (`dvc repro synthesize`, or `eagle3 synthesize`)"
    if not SYNTHESIZED.is_file():
        raise DataError(f"{SYNTHESIZED}: not found: {fix}")
    stats = readers.read_json_object(SYNTHESIZED_STATS, DataError, fix)
    if stats.get("count") != p.synthesize.count:
        raise DataError(
            f"{SYNTHESIZED}: holds prompts for prepare.synthesize.count={stats.get('count')}, "
            f"params say {p.synthesize.count}: {fix}"
        )
    return SYNTHESIZED


def _unique(
    records: Iterator[external_sort.Record], skipped: SkipLog
) -> Iterator[tuple[str, str, bool]]:
    """(id, row line, synthesized?) of sorted records, each id once (the first kept: a given
    row before a synthesized one); the others go to the skip log as duplicates."""
    prev: tuple[str, str] | None = None  # (id, where) of the last row kept
    for sample_id, _, payload in records:
        meta, line = payload.split("\t", 1)
        where_fields, is_synthesized = json.loads(meta)
        where = Where(*where_fields)
        if prev is not None and prev[0] == sample_id:
            skipped.add(where, "duplicate", _duplicate(sample_id, prev[1]))
            continue
        prev = (sample_id, str(where))
        yield sample_id, line, is_synthesized


class _Mix:
    """prepare.synthesized_share: the rows of both sources are spooled to `scratch` once (ranks
    in memory, 8 bytes a row), then each source's first rows by mix_rank are taken, in id order."""

    def __init__(self, share: float, scratch: Path) -> None:
        self.share, self.scratch = share, scratch
        self.available = [0, 0]  # given, synthesized
        self.taken = [0, 0]

    @property
    def left_out(self) -> int:
        return sum(self.available) - sum(self.taken)

    def select(self, rows: Iterator[tuple[str, str, bool]]) -> Iterator[tuple[str, str, bool]]:
        ranks = (array("Q"), array("Q"))
        spool = self.scratch / "mix.jsonl"
        with open(spool, "w", encoding="utf-8") as fh:
            for sample_id, line, is_synthesized in rows:
                ranks[is_synthesized].append(mix_rank(sample_id))
                fh.write(json.dumps([sample_id, is_synthesized]) + "\t" + line + "\n")
        self.available = [len(r) for r in ranks]
        syn, given = mix_counts(self.available[1], self.available[0], self.share)
        # A row is taken when its rank is among its source's first n (ties: 64-bit hashes).
        limits = [_nth_smallest(r, n) for r, n in zip(ranks, (given, syn), strict=True)]
        with open(spool, encoding="utf-8") as fh:
            for text in fh:
                head, line = text.rstrip("\n").split("\t", 1)
                sample_id, is_synthesized = json.loads(head)
                limit = limits[is_synthesized]
                if limit is not None and mix_rank(sample_id) <= limit:
                    self.taken[is_synthesized] += 1
                    yield sample_id, line, is_synthesized
        spool.unlink()

    def how(self) -> str:
        (given, syn), (n_given, n_syn) = self.taken, self.available
        return (
            f"prepare.synthesized_share={self.share:g}: took {syn} of {n_syn} synthesized and "
            f"{given} of {n_given} given usable prompts"
        )

    def nothing_taken(self, source: Path) -> str:
        n_given, n_syn = self.available
        return (
            f"{source}: prepare.synthesized_share={self.share:g} takes no prompt from "
            f"{n_syn} synthesized and {n_given} given usable ones: add given prompts, or set "
            "prepare.synthesized_share: 1.0 (synthesized only) or null (all of both)"
        )


def _nth_smallest(values: array, n: int) -> int | None:
    """The n-th smallest of `values` (None for n = 0: take none)."""
    if n <= 0:
        return None
    return int(np.partition(np.frombuffer(values, dtype=np.uint64), n - 1)[n - 1])


class _Reader:
    """Every row of the given prompt set (None: not read), then of the synthesized prompts (None:
    none), as sort records `(id, seq, "[where, synthesized?] JSON\\t<row JSON>")`; unusable rows
    go to the skip log. Logs its rate every LOG_EVERY_S seconds."""

    def __init__(
        self, source: Path | None, params: Params, skipped: SkipLog, synthesized: Path | None
    ) -> None:
        self.source, self.params, self.skipped = source, params, skipped
        self.synthesized = synthesized
        self.rows = 0

    def records(self) -> Iterator[external_sort.Record]:
        p = self.params.prepare
        sources = [(self.source, p.trailing_assistant, p.id_field, False)] if self.source else []
        if self.synthesized is not None:  # the project's own format: ids in `id`, no answers
            sources.append((self.synthesized, "refuse", None, True))
        t0 = last = time.monotonic()
        for path, trailing, id_field, is_synthesized in sources:
            for where, row in formats.read(path, trailing, id_field):
                self.rows += 1
                if self.rows % 1024 == 0 and (now := time.monotonic()) - last >= LOG_EVERY_S:
                    last = now
                    log(STAGE, f"read {self.rows} rows ({self.rows / (now - t0):.0f} rows/s)")
                if isinstance(row, formats.Unusable):
                    self.skipped.add(where, row.reason, row.detail)
                    continue
                meta = json.dumps([list(where), is_synthesized])
                yield row["id"], self.rows, f"{meta}\t{json.dumps(row, sort_keys=True)}"


def _duplicate(sample_id: str, first: str) -> str:
    if formats.is_derived_id(sample_id):
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
