"""Plain readers of the JSON files stages exchange (writers are in atomic.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def read_json_object(path: Path, error: type[Exception], fix: str) -> dict[str, Any]:
    """A JSON object, or `error` as one line naming the file and the fix."""
    if not path.is_file():
        raise error(f"{path}: not found: {fix}")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise error(f"{path}: not valid JSON (line {exc.lineno}): {fix}") from None
    if not isinstance(data, dict):
        raise error(f"{path}: top level is not a JSON object: {fix}")
    return data
