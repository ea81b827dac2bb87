"""generate, backend vllm.

Fast tests: the stage's failed-row sidecar and its stop on a dead server, against a scripted fake
server on 127.0.0.1 (the chat client itself: tests/unit/serving/test_chat.py). Marked `vllm`: the
stage against a real vLLM server (reasoning split by its deepseek_r1 parser; resume after SIGKILL
with no server left behind). One server is shared by the module; the killed stage starts its own.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml
from fake_openai import DROP, error, fake_servers, sequence
from fake_openai import reply as _reply
from fake_openai import row_id as _row_id

from eagle3_pipeline import atomic, readers, resume
from eagle3_pipeline.errors import ServerError
from eagle3_pipeline.params import Params
from eagle3_pipeline.serving import chat as chat_client
from eagle3_pipeline.serving import server as vllm_server
from eagle3_pipeline.serving.chat import ChatClient
from eagle3_pipeline.stages import generate


@pytest.fixture
def fake() -> Iterator:
    with fake_servers() as start:
        yield start


# ---------------------------------------------------------------------------------------------
# the stage against the fake server


def _prepare(root: Path, n: int) -> list[str]:
    ids = [f"q{i:02d}" for i in range(n)]
    rows = [{"id": i, "messages": [{"role": "user", "content": f"question {i}"}]} for i in ids]
    cut = n - max(1, n // 5)
    atomic.write_jsonl(root / "data/prepared/train.jsonl", rows[:cut])
    atomic.write_jsonl(root / "data/prepared/val.jsonl", rows[cut:])
    return ids


def _fake_verifier(root: Path) -> Path:
    path = root / "verifier"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"num_hidden_layers": 8}))
    return path


def _params(verifier: Path, **generate_kw: Any) -> Params:
    return Params.model_validate(
        {
            "seed": 7,
            "verifier": {"path": str(verifier)},
            "generate": {"backend": "vllm", "max_new_tokens": 8} | generate_kw,
        }
    )


def _output_rows(root: Path) -> list[dict]:
    out = root / "data/generated"
    return readers.read_jsonl(out / "train.jsonl") + readers.read_jsonl(out / "val.jsonl")


def test_stage_failed_rows_go_to_the_sidecar_and_a_rerun_retries_only_them(
    tmp_path: Path, fake, monkeypatch
) -> None:
    monkeypatch.chdir(tmp_path)
    ids = _prepare(tmp_path, 10)

    def healthy(body: dict) -> tuple[int, dict]:
        rid = _row_id(body)
        return _reply(f"think {rid}", f"answer {rid}" if rid != "q07" else None, "stop")

    def flaky(body: dict) -> tuple[int, dict]:
        rid = _row_id(body)
        if rid == "q03":
            return error(400, "prompt is too long")
        if rid == "q05":
            return error(500, "engine hiccup")
        return healthy(body)

    server = fake(flaky)
    params = _params(_fake_verifier(tmp_path), server_url=server.url, max_retries=1)
    monkeypatch.setattr(ChatClient, "backoff", lambda self, attempt: 0.01)
    generate.run(params)

    failed = readers.read_jsonl(tmp_path / "data/generated/failed.jsonl")
    assert [f["id"] for f in failed] == ["q03", "q05"]
    assert failed[0]["reason"] == "HTTP 400: prompt is too long"
    assert failed[1]["reason"].startswith("HTTP 500: engine hiccup (gave up after 2 attempts")
    rows = {r["id"]: r for r in _output_rows(tmp_path)}
    assert sorted(rows) == [i for i in ids if i not in ("q03", "q05")]
    assert rows["q01"] == {
        "id": "q01",
        "split": "train",
        "messages": [{"role": "user", "content": "question q01"}],
        "reasoning": "think q01",
        "content": "answer q01",
        "finish_reason": "stop",
    }
    assert rows["q07"]["content"] == ""  # vLLM's null content (nothing after </think>)
    body = server.bodies[0]
    assert body["model"] == "verifier" and body["max_tokens"] == 8
    assert body["chat_template_kwargs"] == {"thinking": True}
    assert body["skip_special_tokens"] is False
    seeds = {_row_id(b): b["seed"] for b in server.bodies}
    assert seeds["q01"] == generate._row_seed(7, "q01") != seeds["q02"]
    assert server.requested_ids().count("q05") == 2 and server.requested_ids().count("q03") == 1

    # Another server and other fetch settings: what rows contain is unchanged, the journal stays.
    other = fake(healthy)
    knobs = {"server_url": other.url, "concurrency": 2, "max_retries": 0}
    generate.run(params.model_copy(update={"generate": params.generate.model_copy(update=knobs)}))
    assert sorted(other.requested_ids()) == ["q03", "q05"]
    assert sorted(r["id"] for r in _output_rows(tmp_path)) == ids
    assert readers.read_jsonl(tmp_path / "data/generated/failed.jsonl") == []


def test_stage_where_every_request_fails_is_anerror(tmp_path: Path, fake, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    _prepare(tmp_path, 4)
    server = fake(sequence(error(400, "max_tokens=4000 cannot be greater than max_model_len")))
    params = _params(_fake_verifier(tmp_path), server_url=server.url)
    with pytest.raises(ServerError, match=r"all 4 requests to .* failed, e\.g\. q00: HTTP 400"):
        generate.run(params)
    assert not (tmp_path / "data/generated").exists()


def test_stage_stops_when_the_server_stops_answering(tmp_path: Path, fake, monkeypatch) -> None:
    """A dead server costs one row's retries, not every remaining row's."""
    monkeypatch.chdir(tmp_path)
    ids = _prepare(tmp_path, 10)

    def dies_after_three(body: dict) -> Any:
        if len(server.bodies) <= 3:
            return _reply("r", "c")
        server.models_status = 503
        return DROP

    server = fake(dies_after_three)
    monkeypatch.setattr(ChatClient, "backoff", lambda self, attempt: 0.01)
    params = _params(_fake_verifier(tmp_path), server_url=server.url, concurrency=1, max_retries=2)
    with pytest.raises(ServerError, match=r"stopped answering \(q03: connection error.*rerun to"):
        generate.run(params)
    assert server.requested_ids().count("q03") == 3  # one row's three attempts, then stop
    assert len(server.bodies) <= 3 + 3 + 1  # + the next row, maybe already sent by the worker
    journal = resume.Journal(tmp_path / "data/.work/generate/done.jsonl").read()
    assert [r["id"] for r in journal] == ids[:3]
    assert not (tmp_path / "data/generated").exists()


def test_unreachable_server_url_is_a_one_lineerror(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    _prepare(tmp_path, 2)
    url = f"http://127.0.0.1:{vllm_server.free_port()}"
    with pytest.raises(ServerError, match="no answer from the server.*generate.server_url"):
        generate.run(_params(_fake_verifier(tmp_path), server_url=url))


# ---------------------------------------------------------------------------------------------
# the stage against a real vLLM server

from server_procs import TAG_VAR, tagged_pids, wait_none_tagged  # noqa: E402

N_ROWS = 24
SAMPLING = {"temperature": 1.0, "max_new_tokens": 48, "chat_template_kwargs": {"thinking": True}}


@pytest.fixture(scope="module")
def vllm_verifier(tiny_verifier_dir: Path) -> Path:
    return tiny_verifier_dir


@pytest.fixture(scope="module")
def served(vllm_verifier: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One real server for the module, started as the stage starts its own."""
    tag = uuid.uuid4().hex
    params = _params(vllm_verifier, **SAMPLING)
    spec = generate.server_spec(params)
    spec.log_file = tmp_path_factory.mktemp("server") / "server.log"
    spec.env = {TAG_VAR: tag}
    with vllm_server.serve(spec) as url:
        yield url
    assert wait_none_tagged(tag) == [], "the server outlived its `with` block"


@pytest.mark.vllm
def test_rows_are_split_by_the_real_reasoning_parser(
    tmp_path: Path, served: str, vllm_verifier: Path, monkeypatch
) -> None:
    from transformers import AutoTokenizer

    monkeypatch.chdir(tmp_path)
    _prepare(tmp_path, N_ROWS)
    params = _params(vllm_verifier, server_url=served, concurrency=4, **SAMPLING)
    generate.run(params)
    rows = _output_rows(tmp_path)
    assert len(rows) == N_ROWS
    assert all(isinstance(r["reasoning"], str) and "</think>" not in r["reasoning"] for r in rows)
    split = [r for r in rows if r["content"]]
    assert split, "no answer reached </think>: the parser never split"

    # A request with the generated token ids: the parser's split is exactly the text before and
    # after the generated </think>. (Not compared with the stage's rows: sampling in a different
    # batch composition is not bitwise reproducible.)
    tokenizer = AutoTokenizer.from_pretrained(vllm_verifier)
    checked = 0
    for row in rows:
        body = generate.request_body(params, "verifier", row) | {"return_token_ids": True}
        response = requests.post(f"{served}/v1/chat/completions", json=body, timeout=60).json()
        reply = chat_client.parse_reply(response)
        text = tokenizer.decode(response["choices"][0]["token_ids"], skip_special_tokens=False)
        text = text.removesuffix(tokenizer.eos_token)
        if "</think>" not in text:
            continue
        assert generate.split_reasoning(text) == (reply.reasoning, reply.content)
        checked += 1
        if checked == 3:
            break
    assert checked, "no reply reached </think>"


def _write_repo(root: Path, verifier: Path) -> list[str]:
    ids = _prepare(root, N_ROWS)
    params = {
        "verifier": {"path": str(verifier)},
        "generate": {"backend": "vllm", "concurrency": 1} | SAMPLING,
    }
    (root / "params.yaml").write_text(yaml.safe_dump(params))
    return ids


def _wait_journal(journal: Path, proc: subprocess.Popen, n: int, log: Path) -> None:
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"stage exited early:\n{log.read_text()[-3000:]}"
        if journal.exists() and journal.read_bytes().count(b"\n") >= n:
            return
        time.sleep(0.1)
    raise AssertionError(f"no {n} journaled rows in time:\n{log.read_text()[-3000:]}")


@pytest.mark.vllm
def test_sigkill_mid_run_leaves_no_server_and_a_rerun_resumes_by_id(
    tmp_path: Path, served: str, vllm_verifier: Path, monkeypatch
) -> None:
    ids = _write_repo(tmp_path, vllm_verifier)
    tag = uuid.uuid4().hex
    log = tmp_path / "stage.log"
    journal = tmp_path / "data/.work/generate/done.jsonl"
    eagle3 = Path(sys.executable).with_name("eagle3")
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [str(eagle3), "generate"],
            cwd=tmp_path,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=os.environ | {TAG_VAR: tag},
        )
    try:
        _wait_journal(journal, proc, 4, log)
        assert len(tagged_pids(tag)) >= 3  # the stage, the watchdog, vLLM's processes
        proc.send_signal(signal.SIGKILL)  # no cleanup runs in the stage: the watchdog must act
        proc.wait()
        assert wait_none_tagged(tag) == [], "the killed stage left its vLLM server running"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert (tmp_path / "data/.work/generate/server.log").stat().st_size > 0
    assert "starting server" in log.read_text()
    before = {r["id"] for r in resume.Journal(journal).read()}
    assert 4 <= len(before) < N_ROWS

    requested: list[str] = []
    original = ChatClient.chat
    monkeypatch.setattr(
        ChatClient,
        "chat",
        lambda self, body: requested.append(_row_id(body)) or original(self, body),
    )
    monkeypatch.chdir(tmp_path)
    raw = yaml.safe_load((tmp_path / "params.yaml").read_text())
    # The same rows, fetched faster from the module's server: fetch settings keep the journal.
    raw["generate"] |= {"server_url": served, "concurrency": 4}
    generate.run(Params.model_validate(raw))
    assert sorted(requested) == sorted(set(ids) - before)
    journaled = [r["id"] for r in resume.Journal(journal).read()]
    assert sorted(journaled) == ids  # each row exactly once: none was requested twice
    rows = _output_rows(tmp_path)
    assert sorted(r["id"] for r in rows) == ids
    assert all(
        set(r) == {"id", "split", "messages", "reasoning", "content", "finish_reason"} for r in rows
    )
