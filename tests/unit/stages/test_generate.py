"""generate: reasoning split, resume by id after a kill without redoing finished batches, and
backend vllm's failed-row sidecar and stop on a dead server (against a scripted fake server)."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import stand_in_server as stand_in
from builders import stand_in_verifier
from fake_openai import DROP, error, fake_servers, reply, sequence
from fake_openai import row_id as _row_id
from generate_workspace import output_rows, prepare_rows, vllm_params

from eagle3_pipeline.config.params import Params
from eagle3_pipeline.conversations import generation_rows
from eagle3_pipeline.core import atomic, readers, resume
from eagle3_pipeline.core.errors import ServerError
from eagle3_pipeline.serving import server as vllm_server
from eagle3_pipeline.stages import generate
from eagle3_pipeline.verifier.identity import read_verifier

EMITTED = [11, 12, 13]  # what the fake verifier "emitted", as vLLM returns it with token ids


def _reply(reasoning: str | None, content: str | None, finish: str = "stop") -> tuple[int, dict]:
    return reply(reasoning, content, finish, token_ids=EMITTED)


def test_split_reasoning() -> None:
    assert generation_rows.split_reasoning("I think.</think>The answer.") == (
        "I think.",
        "The answer.",
    )
    assert generation_rows.split_reasoning("no end") == ("no end", "")
    assert generation_rows.split_reasoning("</think>") == ("", "")
    # as vLLM's deepseek_r1 parser: a <think> the model emits restarts the reasoning
    assert generation_rows.split_reasoning("a<think>b</think>c</think>d") == ("b", "c</think>d")


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
        lambda p, v, batches, j, pr: (
            generated_batches.extend(batches),
            original_gen(p, v, batches, j, pr),
        )[1],
    )
    generate.run(params)
    assert len(generated_batches) == 2  # 4 batches of 3, 2 finished before the kill
    assert (run_dir / "data/generated/train.jsonl").read_text() == reference
    rows = [json.loads(x) for x in reference.splitlines()]
    assert {r["id"] for r in rows} == {f"q{i:02d}" for i in range(8)}
    assert all(set(r) >= {"reasoning", "content", "finish_reason", "messages"} for r in rows)


def test_a_row_key_changes_with_what_makes_the_row_and_nothing_else(
    tmp_path: Path, tiny_verifier_dir: Path, monkeypatch
) -> None:
    monkeypatch.chdir(tmp_path)
    params = _setup(tmp_path, tiny_verifier_dir)
    row = {"id": "q01", "split": "train", "messages": [{"role": "user", "content": "What?"}]}
    stamp = read_verifier(params.verifier).stamp
    settings = generate.settings_key(params, stamp)
    key = generate.row_key(settings, row)
    assert generate.row_key(settings, row | {"split": "val"}) == key  # prepare's, not the row's
    assert generate.row_key(settings, row | {"id": "q02"}) != key  # the id seeds the request
    assert generate.row_key(settings, row | {"messages": []}) != key
    assert generate.row_key(settings, row | {"tools": TOOLS}) != key
    fetch = {"server_url": "http://x:1", "concurrency": 2, "max_retries": 0}
    other_fetch = params.generate.model_copy(update=fetch)
    assert (
        generate.settings_key(params.model_copy(update={"generate": other_fetch}), stamp)
        == settings
    )
    hotter = params.generate.model_copy(update={"temperature": 0.7})
    assert generate.settings_key(params.model_copy(update={"generate": hotter}), stamp) != settings
    assert generate.settings_key(params.model_copy(update={"seed": 1}), stamp) != settings
    monkeypatch.setattr(generate, "ROW_VERSION", generate.ROW_VERSION + 1)
    assert (
        generate.settings_key(params, stamp) != settings
    )  # rows made by older code are made again


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather"}}]


def test_tools_reach_the_server_and_the_output_row() -> None:
    params = Params.model_validate({"vocab": {"draft_vocab_size": 256}})
    row = {"id": "t", "split": "train", "messages": [{"role": "user", "content": "x"}]}
    plain = generation_rows.request_body(params.generate, params.seed, "verifier", row)
    assert "tools" not in plain and "tool_choice" not in plain
    body = generation_rows.request_body(
        params.generate, params.seed, "verifier", row | {"tools": TOOLS}
    )
    # rendered into the prompt; the reply stays raw text (no tool parser runs)
    assert body["tools"] == TOOLS and body["tool_choice"] == "none"
    assert body["return_token_ids"] is True  # tokenize trains on the emitted ids
    assert (
        generation_rows.output_row(row | {"tools": TOOLS}, None, "a", "stop", [1], None)["tools"]
        == TOOLS
    )
    assert list(generation_rows.output_row(row, None, "a", "stop", [1], [2])) == [
        "id",
        "split",
        "messages",
        "reasoning",
        "content",
        "finish_reason",
        "prompt_token_ids",
        "completion_token_ids",
    ]  # rows without tools have no tools key


def test_hf_backend_without_reasoning_parser_keeps_the_whole_reply(
    tmp_path: Path, tiny_verifier_dir: Path, monkeypatch
) -> None:
    monkeypatch.chdir(tmp_path)
    params = _setup(tmp_path, tiny_verifier_dir)
    params.generate.reasoning_parser = None
    generate.run(params)
    rows = readers.read_jsonl(tmp_path / "data/generated/train.jsonl")
    assert all(r["reasoning"] is None and r["content"] for r in rows)


# ---------------------------------------------------------------------------------------------
# backend vllm: the stage against a scripted fake server on 127.0.0.1 (the chat client itself:
# tests/unit/serving/test_chat.py; against real vLLM: tests/integration/test_generate_vllm.py)


@pytest.fixture
def fake() -> Iterator:
    with fake_servers() as start:
        yield start


def test_stage_failed_rows_go_to_the_sidecar_and_a_rerun_retries_only_them(
    tmp_path: Path, fake, monkeypatch
) -> None:
    monkeypatch.chdir(tmp_path)
    ids = prepare_rows(tmp_path, 10)

    def healthy(body: dict) -> tuple[int, dict]:
        rid = _row_id(body)
        return _reply(f"think {rid}", f"answer {rid}" if rid != "q07" else None, "stop")

    def flaky(body: dict) -> tuple[int, dict]:
        rid = _row_id(body)
        if rid == "q03":
            return error(400, "prompt is too long")
        if rid == "q05":
            return error(500, "engine hiccup", retry_after_s=0.01)
        return healthy(body)

    server = fake(flaky)
    params = vllm_params(stand_in_verifier(tmp_path), server_url=server.url, max_retries=1)
    generate.run(params)

    failed = readers.read_jsonl(tmp_path / "data/generated/failed.jsonl")
    assert [f["id"] for f in failed] == ["q03", "q05"]
    assert failed[0]["reason"] == "HTTP 400: prompt is too long"
    assert failed[1]["reason"].startswith("HTTP 500: engine hiccup (gave up after 2 attempts")
    rows = {r["id"]: r for r in output_rows(tmp_path)}
    assert sorted(rows) == [i for i in ids if i not in ("q03", "q05")]
    assert rows["q01"] == {
        "id": "q01",
        "split": "train",
        "messages": [{"role": "user", "content": "question q01"}],
        "reasoning": "think q01",
        "content": "answer q01",
        "finish_reason": "stop",
        "prompt_token_ids": None,  # the fake server sends none; vLLM does
        "completion_token_ids": EMITTED,
        "row_key": generate.row_key(
            generate.settings_key(params, read_verifier(params.verifier).stamp), rows["q01"]
        ),
    }
    assert rows["q07"]["content"] == ""  # vLLM's null content (nothing after </think>)
    body = server.bodies[0]
    assert body["model"] == "verifier" and body["max_tokens"] == 8
    assert body["chat_template_kwargs"] == {"thinking": True}
    assert body["skip_special_tokens"] is False
    seeds = {_row_id(b): b["seed"] for b in server.bodies}
    assert seeds["q01"] == generation_rows.row_seed(7, "q01") != seeds["q02"]
    assert server.requested_ids().count("q05") == 2 and server.requested_ids().count("q03") == 1

    # Another server and other fetch settings: what rows contain is unchanged, the journal stays.
    other = fake(healthy)
    knobs = {"server_url": other.url, "concurrency": 2, "max_retries": 0}
    generate.run(params.model_copy(update={"generate": params.generate.model_copy(update=knobs)}))
    assert sorted(other.requested_ids()) == ["q03", "q05"]
    assert sorted(r["id"] for r in output_rows(tmp_path)) == ids
    assert readers.read_jsonl(tmp_path / "data/generated/failed.jsonl") == []


def test_a_server_without_token_ids_is_refused_in_one_line(
    tmp_path: Path, fake, monkeypatch
) -> None:
    monkeypatch.chdir(tmp_path)
    prepare_rows(tmp_path, 4)
    server = fake(sequence(reply("r", "c")))  # no token_ids: text only
    params = vllm_params(stand_in_verifier(tmp_path), server_url=server.url)
    with pytest.raises(ServerError, match=r"^q0\d: the server returned no token_ids"):
        generate.run(params)
    assert not (tmp_path / "data/generated").exists()


def test_stage_where_every_request_fails_is_anerror(tmp_path: Path, fake, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    prepare_rows(tmp_path, 4)
    server = fake(sequence(error(400, "max_tokens=4000 cannot be greater than max_model_len")))
    params = vllm_params(stand_in_verifier(tmp_path), server_url=server.url)
    with pytest.raises(ServerError, match=r"all 4 requests to .* failed, e\.g\. q00: HTTP 400"):
        generate.run(params)
    assert not (tmp_path / "data/generated").exists()


def test_stage_stops_when_the_server_stops_answering(tmp_path: Path, fake, monkeypatch) -> None:
    """A dead server costs one row's retries, not every remaining row's."""
    monkeypatch.chdir(tmp_path)
    ids = prepare_rows(tmp_path, 10)

    def dies_after_three(body: dict) -> Any:
        if len(server.bodies) <= 3:
            return _reply("r", "c")
        server.models_status = 503
        return DROP

    server = fake(dies_after_three)
    params = vllm_params(
        stand_in_verifier(tmp_path), server_url=server.url, concurrency=1, max_retries=2
    )
    with pytest.raises(ServerError, match=r"stopped answering \(q03: connection error.*rerun to"):
        generate.run(params)
    assert server.requested_ids().count("q03") == 3  # one row's three attempts, then stop
    assert len(server.bodies) <= 3 + 3 + 1  # + the next row, maybe already sent by the worker
    journal = resume.Journal(tmp_path / "data/.work/generate/done.jsonl").read()
    assert [r["id"] for r in journal] == ids[:3]
    assert not (tmp_path / "data/generated").exists()


def test_unreachable_server_url_is_a_one_lineerror(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    prepare_rows(tmp_path, 2)
    url = f"http://127.0.0.1:{vllm_server.free_port()}"
    with pytest.raises(ServerError, match="no answer from the server.*generate.server_url"):
        generate.run(vllm_params(stand_in_verifier(tmp_path), server_url=url))


def test_a_server_the_stage_started_that_dies_ends_it_in_seconds_in_one_line(
    tmp_path: Path, tiny_verifier_dir: Path, monkeypatch
) -> None:
    """The stage's own server killed with requests in flight: the stage ends within seconds
    naming the server, the cause and its log, and says a rerun resumes (no retries waited)."""
    stand_in.use_stand_in(monkeypatch)
    monkeypatch.chdir(tmp_path)
    prepare_rows(tmp_path, 4)
    log_file = tmp_path / generate.SERVER_LOG
    killer = threading.Thread(
        target=lambda: (
            stand_in.wait_asked(log_file),
            stand_in.kill(stand_in.server_url(log_file), "api"),
        ),
        daemon=True,
    )
    killer.start()
    t0 = time.monotonic()
    with pytest.raises(ServerError) as raised:
        generate.run(vllm_params(tiny_verifier_dir, concurrency=2))
    assert time.monotonic() - t0 < 40  # the stand-in's start included
    message = str(raised.value)
    assert re.fullmatch(
        r"vLLM server http://127\.0\.0\.1:\d+ stopped: vLLM was killed by SIGKILL "
        rf"\(log {re.escape(str(generate.SERVER_LOG))}: .*\); rerun to resume: finished rows "
        "are kept",
        message,
    ), message
