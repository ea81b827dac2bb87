"""generate: reasoning split, and resume by id after a kill without redoing finished batches."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eagle3_pipeline import atomic, readers, resume
from eagle3_pipeline.params import Params
from eagle3_pipeline.stages import generate


def test_split_reasoning() -> None:
    assert generate.split_reasoning("I think.</think>The answer.") == ("I think.", "The answer.")
    assert generate.split_reasoning("no end") == ("no end", "")
    assert generate.split_reasoning("</think>") == ("", "")
    # as vLLM's deepseek_r1 parser: a <think> the model emits restarts the reasoning
    assert generate.split_reasoning("a<think>b</think>c</think>d") == ("b", "c</think>d")


def _setup(tmp: Path, verifier: Path) -> Params:
    rows = [
        {"id": f"q{i:02d}", "messages": [{"role": "user", "content": f"What is {i}?"}]}
        for i in range(10)
    ]
    atomic.write_jsonl(tmp / "data/prepared/train.jsonl", rows[:8])
    atomic.write_jsonl(tmp / "data/prepared/val.jsonl", rows[8:])
    return Params.model_validate(
        {
            "verifier": {"path": str(verifier)},
            "generate": {"batch_size": 3, "max_new_tokens": 8},
            "vocab": {"draft_vocab_size": 256},
        }
    )


def test_resume_after_kill(tmp_path: Path, tiny_verifier_dir: Path, monkeypatch) -> None:
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
    monkeypatch.chdir(ref_dir.mkdir() or ref_dir)
    params = _setup(ref_dir, tiny_verifier_dir)
    generate.run(params)
    reference = (ref_dir / "data/generated/train.jsonl").read_text()

    monkeypatch.chdir(run_dir.mkdir() or run_dir)
    params = _setup(run_dir, tiny_verifier_dir)
    calls = {"n": 0}
    original_append = resume.Journal.append

    def append_then_die(self, rows):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt  # killed while the third batch was in flight
        original_append(self, rows)

    monkeypatch.setattr(resume.Journal, "append", append_then_die)
    with pytest.raises(KeyboardInterrupt):
        generate.run(params)
    assert not (run_dir / "data/generated").exists()  # nothing half-written
    monkeypatch.setattr(resume.Journal, "append", original_append)

    generated_batches = []
    original_gen = generate._generate_hf
    monkeypatch.setattr(
        generate,
        "_generate_hf",
        lambda p, batches, j, pr: (
            generated_batches.extend(batches),
            original_gen(p, batches, j, pr),
        )[1],
    )
    generate.run(params)
    assert len(generated_batches) == 2  # 4 batches of 3, 2 finished before the kill
    assert (run_dir / "data/generated/train.jsonl").read_text() == reference
    rows = [json.loads(x) for x in reference.splitlines()]
    assert {r["id"] for r in rows} == {f"q{i:02d}" for i in range(8)}
    assert all(set(r) >= {"reasoning", "content", "finish_reason", "messages"} for r in rows)


def test_rows_from_older_code_do_not_survive_a_code_fix(
    tmp_path: Path, tiny_verifier_dir: Path, monkeypatch
) -> None:
    monkeypatch.chdir(tmp_path)
    params = _setup(tmp_path, tiny_verifier_dir)
    key = generate._fingerprint(params)
    assert generate._fingerprint(params) == key
    real = generate.stage_deps.code_sha256
    assert real("generate") == real("generate")
    monkeypatch.setattr(generate.stage_deps, "code_sha256", lambda stage: real(stage) + "-fixed")
    assert generate._fingerprint(params) != key  # a new scratch folder: no old row reused


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather"}}]


def test_tools_reach_the_server_and_the_output_row() -> None:
    params = Params.model_validate({"vocab": {"draft_vocab_size": 256}})
    row = {"id": "t", "split": "train", "messages": [{"role": "user", "content": "x"}]}
    plain = generate.request_body(params, "verifier", row)
    assert "tools" not in plain and "tool_choice" not in plain
    body = generate.request_body(params, "verifier", row | {"tools": TOOLS})
    # rendered into the prompt; the reply stays raw text (no tool parser runs)
    assert body["tools"] == TOOLS and body["tool_choice"] == "none"
    assert generate._row(row | {"tools": TOOLS}, None, "a", "stop")["tools"] == TOOLS
    assert list(generate._row(row, None, "a", "stop")) == [
        "id",
        "split",
        "messages",
        "reasoning",
        "content",
        "finish_reason",
    ]  # rows without tools are written exactly as before


def test_hf_backend_without_reasoning_parser_keeps_the_whole_reply(
    tmp_path: Path, tiny_verifier_dir: Path, monkeypatch
) -> None:
    monkeypatch.chdir(tmp_path)
    params = _setup(tmp_path, tiny_verifier_dir)
    params.generate.reasoning_parser = None
    generate.run(params)
    rows = readers.read_jsonl(tmp_path / "data/generated/train.jsonl")
    assert all(r["reasoning"] is None and r["content"] for r in rows)
