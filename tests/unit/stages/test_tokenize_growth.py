"""tokenize grows by rows: generated rows added, changed and removed are the only ones
tokenized, from the published output alone, and the output equals a run from scratch."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from eagle3_pipeline.config.params import Params
from eagle3_pipeline.core import atomic
from eagle3_pipeline.stages import tokenize


def _generated(root: Path, ids: dict[str, list[int]], val: set[str]) -> None:
    rows = {"train": [], "val": []}
    for rid, completion in sorted(ids.items()):
        split = "val" if rid in val else "train"
        rows[split].append(
            {
                "id": rid,
                "split": split,
                "messages": [{"role": "user", "content": f"question {rid}"}],
                "reasoning": None,
                "content": "x",
                "finish_reason": "stop",
                "prompt_token_ids": None,
                "completion_token_ids": completion,
            }
        )
    for split, rs in rows.items():
        atomic.write_jsonl(root / f"data/generated/{split}.jsonl", rs)


def _published(root: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted((root / "data/tokenized").iterdir())}


def test_only_new_and_changed_rows_are_tokenized(
    tiny_verifier_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    params = Params.model_validate({"verifier": {"path": str(tiny_verifier_dir)}})
    first = {f"g{i}": [20 + i, 30 + i, 2] for i in range(6)}
    grown = {k: v for k, v in first.items() if k != "g4"} | {"g2": [99, 2], "g6": [26, 2]}
    made: list[str] = []
    real = tokenize.tokenize_row
    monkeypatch.setattr(
        tokenize, "tokenize_row", lambda tok, row, *a: made.append(row["id"]) or real(tok, row, *a)
    )
    run, scratch = tmp_path / "run", tmp_path / "scratch"
    monkeypatch.chdir(run.mkdir() or run)
    _generated(run, first, {"g5"})
    tokenize.run(params)
    assert sorted(made) == sorted(first)
    shutil.rmtree(run / "data/.work", ignore_errors=True)  # tokenize keeps none: the output alone
    _generated(run, grown, {"g1", "g5"})
    made.clear()
    capsys.readouterr()
    tokenize.run(params)
    assert sorted(made) == ["g2", "g6"]  # (a)
    assert "[tokenize] reused 4 of 6 rows from data/tokenized; making 2" in capsys.readouterr().out
    monkeypatch.chdir(scratch.mkdir() or scratch)
    _generated(scratch, grown, {"g1", "g5"})
    tokenize.run(params)
    out = _published(run)
    assert b'"g4"' not in out["train.jsonl"] + out["val.jsonl"]  # (b)
    assert out == _published(scratch)  # (c) rows, splits and token_freq.json
