"""Which node did which part of a stage: written by the fan-out, read into the stage's provenance.

The fan-out runs inside the stage (train) or around it (extract, generate); both leave one JSON
file in data/.work/cluster/, and `provenance.record` copies a record newer than the stage's start
into metrics/provenance/<stage>.json under `cluster`.
"""

from __future__ import annotations

import json
from pathlib import Path

from eagle3_pipeline.core import atomic, paths

RECORDS = paths.SCRATCH / "cluster" / "records"


def write(stage: str, record: dict) -> Path:
    path = RECORDS / f"{stage}.json"
    atomic.write_json(path, record)
    return path


def read(stage: str, since: float) -> dict | None:
    """The stage's record if it was written at or after `since` (epoch seconds), else None."""
    path = RECORDS / f"{stage}.json"
    try:
        if path.stat().st_mtime + 1.0 < since:  # an older run's record
            return None
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
