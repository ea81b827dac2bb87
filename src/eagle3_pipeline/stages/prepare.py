"""Stage `prepare`: prompt files -> conversations with stable ids, split train/val by id hash.

The split depends only on each id (not on file order or the number of prompts), so adding prompts
never moves an existing one between train and val.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from eagle3_pipeline import atomic, paths
from eagle3_pipeline.errors import DataError
from eagle3_pipeline.params import Params
from eagle3_pipeline.progress import log

STAGE = "prepare"
OUTPUT_DIR = paths.PREPARED
_ROLES = {"system", "user", "assistant"}


def is_val(sample_id: str, val_ratio: float) -> bool:
    """Deterministic split: the id's hash, read as a fraction in [0, 1), below val_ratio."""
    digest = hashlib.sha256(sample_id.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < val_ratio


def _prompt_files(source: Path) -> list[Path]:
    if source.is_file():
        return [source]
    if not source.is_dir():
        raise DataError(
            f"{source}: prompt set not found: set prepare.prompts to a .jsonl file or dir"
        )
    return sorted(source.glob("*.jsonl"))


def _validate(row: object, where: str) -> dict:
    if not isinstance(row, dict):
        raise DataError(f"{where}: each line must be a JSON object with 'id' and 'messages'")
    sample_id, messages = row.get("id"), row.get("messages")
    if not isinstance(sample_id, str) or not sample_id:
        raise DataError(f"{where}: field 'id' must be a non-empty string")
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: field 'messages' must be a non-empty list of {{role, content}}")
    for m in messages:
        if (
            not isinstance(m, dict)
            or m.get("role") not in _ROLES
            or not isinstance(m.get("content"), str)
        ):
            raise DataError(
                f"{where}: field 'messages' has an entry that is not "
                "{'role': system|user|assistant, 'content': str}"
            )
    if messages[-1]["role"] != "user":
        raise DataError(f"{where}: field 'messages' must end with a user turn (id {sample_id})")
    return {
        "id": sample_id,
        "messages": [{"role": m["role"], "content": m["content"]} for m in messages],
    }


def load_prompts(source: Path) -> list[dict]:
    rows: list[dict] = []
    seen: dict[str, str] = {}
    for f in _prompt_files(source):
        for n, line in enumerate(f.read_text().splitlines(), 1):
            if not line.strip():
                continue
            where = f"{f}: line {n}"
            try:
                raw = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{where}: not valid JSON ({exc.msg})") from None
            row = _validate(raw, where)
            if row["id"] in seen:
                raise DataError(f"{where}: duplicate id {row['id']!r} (first in {seen[row['id']]})")
            seen[row["id"]] = where
            rows.append(row)
    if not rows:
        raise DataError(f"{source}: prompt set is empty: add .jsonl files with id/messages rows")
    return rows


def run(params: Params) -> None:
    rows = load_prompts(Path(params.prepare.prompts))
    rows.sort(key=lambda r: r["id"])
    if params.prepare.max_prompts:
        rows = rows[: params.prepare.max_prompts]
    train = [r for r in rows if not is_val(r["id"], params.prepare.val_ratio)]
    val = [r for r in rows if is_val(r["id"], params.prepare.val_ratio)]
    if not train:
        raise DataError(
            f"{params.prepare.prompts}: every prompt fell into val: lower prepare.val_ratio"
        )
    with atomic.replace_dir(OUTPUT_DIR) as tmp:
        atomic.write_jsonl(tmp / "train.jsonl", train)
        atomic.write_jsonl(tmp / "val.jsonl", val)
    log(STAGE, f"{len(rows)} conversations -> {len(train)} train, {len(val)} val ({OUTPUT_DIR})")
