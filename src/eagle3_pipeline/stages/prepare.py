"""Stage `prepare`: prompt files -> conversations with stable ids, split train/val by id hash.

Formats and row rules are conversations.py's. The split depends only on each id (not on file
order or the number of prompts), so adding prompts never moves an existing one between train and
val.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from eagle3_pipeline import atomic, conversations, paths
from eagle3_pipeline.errors import DataError
from eagle3_pipeline.params import Params
from eagle3_pipeline.progress import log
from eagle3_pipeline.store import names

STAGE = "prepare"
OUTPUT_DIR = paths.PREPARED


def is_val(sample_id: str, val_ratio: float) -> bool:
    """Deterministic split: the id's hash, read as a fraction in [0, 1), below val_ratio."""
    digest = hashlib.sha256(sample_id.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < val_ratio


def run(params: Params) -> None:
    rows = conversations.load(Path(params.prepare.prompts), params.prepare.trailing_assistant)
    names.check_unique([r["id"] for r in rows], params.prepare.prompts)  # store file names
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
