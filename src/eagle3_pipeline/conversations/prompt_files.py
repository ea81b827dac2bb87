"""Prompt files -> raw rows, streamed: memory holds one batch of rows, never the whole file.

`prepare.prompts` names a file or a folder of files (not recursive; shards such as
`train-00000-of-00003.parquet` are read in name order). Per suffix:

- `.jsonl`: line by line; every row is named by its line.
- `.json`: an array of rows (parsed element by element, each named by its row number) or JSON
  lines.
- `.parquet`: record batches through pyarrow (the reader `datasets` uses; it decodes a row group
  at a time); rows named by number.

A file that cannot be read as what its suffix says (bad JSON, bytes that are not UTF-8, a damaged
parquet file) is fatal: one DataError naming the file, the line and the fix. What a row holds is
formats.py's business.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

from eagle3_pipeline.core.errors import DataError

SUFFIXES = (".jsonl", ".json", ".parquet")
PARQUET_BATCH_ROWS = 1024
_CHUNK_CHARS = 1 << 20
_BOM = "\ufeff"


class Where(NamedTuple):
    """A row's place: `file`, `unit` ("line" in JSON lines, "row" in arrays and parquet), `n`."""

    file: str
    unit: str
    n: int

    def __str__(self) -> str:
        return f"{self.file}: {self.unit} {self.n}"


def prompt_files(source: Path) -> list[Path]:
    if source.is_file():
        return [source]
    if not source.is_dir():
        raise DataError(
            f"{source}: prompt set not found: set prepare.prompts to a file "
            f"({', '.join(SUFFIXES)}) or a directory of them"
        )
    return sorted(f for f in source.iterdir() if f.is_file() and f.suffix in SUFFIXES)


def raw_rows(path: Path) -> Iterator[tuple[Where, Any]]:
    """(where, row) for every row of one file, in file order."""
    if path.suffix == ".parquet":
        yield from _parquet_rows(path)
        return
    with open(path, "rb") as fh:
        start = fh.read(4096)
        fh.seek(0)
        text_start = start.decode("utf-8", "ignore").lstrip(_BOM).lstrip()
        if path.suffix == ".json" and text_start[:1] == "[":
            yield from _json_array_rows(path, fh)
            return
        for n, line in enumerate(fh, 1):
            where = Where(str(path), "line", n)
            text = _decode(line, where)
            if n == 1:
                text = text.lstrip(_BOM)
            if not text.strip():
                continue
            try:
                yield where, json.loads(text)
            except json.JSONDecodeError as exc:
                raise DataError(
                    f"{where}: not valid JSON ({exc.msg}): fix the line, or give the file one "
                    "JSON object per line"
                ) from None


def _decode(data: bytes, where: object) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(
            f"{where}: not UTF-8 (byte 0x{data[exc.start]:02x} at offset {exc.start}): "
            "re-encode the file as UTF-8"
        ) from None


def _parquet_rows(path: Path) -> Iterator[tuple[Where, Any]]:
    import pyarrow.parquet as pq

    def damaged(exc: Exception) -> DataError:
        return DataError(
            f"{path}: not a readable parquet file ({str(exc).splitlines()[0][:200]}): "
            "download it again or remove it from the folder"
        )

    try:
        batches = pq.ParquetFile(path).iter_batches(batch_size=PARQUET_BATCH_ROWS)
    except Exception as exc:  # pyarrow raises several types for a damaged file
        raise damaged(exc) from None
    n = 0
    while True:
        try:
            batch = next(batches, None)
        except Exception as exc:
            raise damaged(exc) from None
        if batch is None:
            return
        for row in batch.to_pylist():
            n += 1
            yield Where(str(path), "row", n), row


def _json_array_rows(path: Path, fh: Any) -> Iterator[tuple[Where, Any]]:
    """Elements of a top-level JSON array, decoded one at a time from 1 MiB chunks."""
    decoder = json.JSONDecoder()
    utf8 = codecs.getincrementaldecoder("utf-8")()
    buf, pos, eof, line_base, n = "", 0, False, 1, 0
    offset = 0  # bytes read so far, for the UTF-8 error

    def more() -> bool:
        nonlocal buf, pos, eof, line_base, offset
        if eof:
            return False
        chunk = fh.read(max(_CHUNK_CHARS, len(buf) - pos))  # doubles for a huge row
        try:
            text = utf8.decode(chunk, final=not chunk)
        except UnicodeDecodeError as exc:
            line = line_base + buf.count("\n") + chunk[: exc.start].count(b"\n")
            raise DataError(
                f"{path}: line {line}: not UTF-8 (byte 0x{exc.object[exc.start]:02x} at offset "
                f"{offset + exc.start}): re-encode the file as UTF-8"
            ) from None
        offset += len(chunk)
        eof = not chunk
        line_base += buf.count("\n", 0, pos)
        buf, pos = buf[pos:] + text, 0
        return True

    def skip_space() -> None:
        nonlocal pos
        while True:
            while pos < len(buf) and buf[pos] in " \t\r\n" + _BOM:
                pos += 1
            if pos < len(buf) or not more():
                return

    def invalid(msg: str, at: int) -> DataError:
        line = line_base + buf.count("\n", 0, at)
        return DataError(f"{path}: line {line}: not valid JSON ({msg}): fix the file")

    more()
    skip_space()
    pos += 1  # the "[" raw_rows saw
    skip_space()
    if buf[pos : pos + 1] == "]":
        return
    while True:
        skip_space()
        while True:
            try:
                row, end = decoder.raw_decode(buf, pos)
                if end < len(buf) or eof:  # a number at the buffer's end may go on
                    break
            except json.JSONDecodeError as exc:
                cut = exc.msg.startswith("Unterminated string") or exc.pos >= len(buf) - 16
                if eof or not cut:
                    raise invalid(exc.msg, exc.pos) from None
            more()
        n += 1
        yield Where(str(path), "row", n), row
        pos = end
        skip_space()
        sep = buf[pos : pos + 1]
        if sep == "]":
            pos += 1
            skip_space()
            if pos < len(buf):
                raise invalid("extra data after the array", pos)
            return
        if sep != ",":
            raise invalid("expected ',' or ']' between rows", pos)
        pos += 1
