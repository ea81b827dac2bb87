"""prepare: stable ids, a split that depends only on the id, clear errors on bad prompt files."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from eagle3_pipeline import readers
from eagle3_pipeline.cli import main
from eagle3_pipeline.conversations import load as load_prompts
from eagle3_pipeline.errors import DataError
from eagle3_pipeline.stages.prepare import is_val

REPO = Path(__file__).resolve().parents[3]


def test_committed_prompt_set() -> None:
    rows = load_prompts(REPO / "data/prompts")
    assert len(rows) >= 200
    assert sum(len(r["messages"]) > 1 for r in rows) >= 20  # multi-turn chats
    val = [r for r in rows if is_val(r["id"], 0.1)]
    assert 0.04 < len(val) / len(rows) < 0.2


def test_split_depends_only_on_id() -> None:
    ids = [f"x{i}" for i in range(1000)]
    first = {i for i in ids if is_val(i, 0.1)}
    assert first == {i for i in reversed(ids) if is_val(i, 0.1)}
    assert 60 < len(first) < 140
    assert first <= {i for i in ids if is_val(i, 0.2)}  # growing val_ratio only adds to val


def _run_prepare(tmp_path: Path, prompts_text: str, capsys) -> tuple[int, str]:
    (tmp_path / "data/prompts").mkdir(parents=True)
    (tmp_path / "data/prompts/p.jsonl").write_text(prompts_text)
    (tmp_path / "params.yaml").write_text((REPO / "params.yaml").read_text())
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        rc = main(["prepare"])
    finally:
        os.chdir(cwd)
    return rc, capsys.readouterr().err


def test_empty_prompt_set_fails_clearly(tmp_path: Path, capsys) -> None:
    rc, err = _run_prepare(tmp_path, "\n", capsys)
    assert rc == 2 and "prompt set is empty" in err and err.count("\n") == 1
    assert not (tmp_path / "data/prepared").exists()


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("{not json", "line 1: not valid JSON"),
        (json.dumps({"id": "a", "messages": []}), "field 'messages'"),
        (json.dumps({"messages": [{"role": "user", "content": "hi"}]}), "field 'id'"),
        (
            json.dumps(
                {
                    "id": "a",
                    "messages": [
                        {"role": "user", "content": "hi"},
                        {"role": "assistant", "content": "x"},
                    ],
                }
            ),
            "must end with a user turn",
        ),
    ],
)
def test_malformed_rows(tmp_path: Path, line: str, expected: str, capsys) -> None:
    rc, err = _run_prepare(tmp_path, line + "\n", capsys)
    assert rc == 2 and expected in err and "p.jsonl" in err


def test_duplicate_ids(tmp_path: Path) -> None:
    row = json.dumps({"id": "a", "messages": [{"role": "user", "content": "hi"}]})
    f = tmp_path / "p.jsonl"
    f.write_text(row + "\n" + row + "\n")
    with pytest.raises(DataError, match="duplicate id"):
        load_prompts(f)


def test_output_rows(tmp_path: Path, capsys) -> None:
    rows = [{"id": f"q{i}", "messages": [{"role": "user", "content": f"q {i}"}]} for i in range(50)]
    rc, _ = _run_prepare(tmp_path, "".join(json.dumps(r) + "\n" for r in rows), capsys)
    assert rc == 0
    train = readers.read_jsonl(tmp_path / "data/prepared/train.jsonl")
    val = readers.read_jsonl(tmp_path / "data/prepared/val.jsonl")
    assert len(train) + len(val) == 50 and {r["id"] for r in val} == {
        r["id"] for r in rows if is_val(r["id"], 0.1)
    }
