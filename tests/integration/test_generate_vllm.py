"""generate, backend vllm, against a real vLLM server: reasoning split by its deepseek_r1
parser; resume after SIGKILL with no server left behind. One server is shared by the module; the
killed stage starts its own. The stage against a scripted fake server:
tests/unit/stages/test_generate.py.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
import yaml
from fake_openai import error, fake_servers
from fake_openai import row_id as _row_id
from generate_workspace import output_rows, prepare_rows, vllm_params
from server_procs import TAG_VAR, tagged_pids, wait_none_tagged

from eagle3_pipeline.config.params import Params
from eagle3_pipeline.conversations import chat_template, generation_rows
from eagle3_pipeline.core import resume
from eagle3_pipeline.serving.chat import ChatClient
from eagle3_pipeline.stages import generate

N_ROWS = 24
SAMPLING = {"temperature": 1.0, "max_new_tokens": 48, "chat_template_kwargs": {"thinking": True}}


@pytest.fixture(scope="module")
def vllm_verifier(tiny_verifier_dir: Path) -> Path:
    return tiny_verifier_dir


@pytest.fixture(scope="module")
def served(generate_server: str) -> str:
    """A real server started as the stage starts its own (the session's: tests/conftest.py)."""
    return generate_server


@pytest.mark.vllm
def test_rows_are_split_by_the_real_reasoning_parser(
    tmp_path: Path, served: str, vllm_verifier: Path, monkeypatch
) -> None:
    from transformers import AutoTokenizer

    monkeypatch.chdir(tmp_path)
    prepare_rows(tmp_path, N_ROWS)
    params = vllm_params(vllm_verifier, server_url=served, concurrency=4, **SAMPLING)
    generate.run(params)
    rows = output_rows(tmp_path)
    assert len(rows) == N_ROWS
    assert all(isinstance(r["reasoning"], str) and "</think>" not in r["reasoning"] for r in rows)
    split = [r for r in rows if r["content"]]
    assert split, "no answer reached </think>: the parser never split"

    # A request with the generated token ids: the parser's split is exactly the text before and
    # after the generated </think>. (Not compared with the stage's rows: sampling in a different
    # batch composition is not bitwise reproducible.)
    tokenizer = AutoTokenizer.from_pretrained(vllm_verifier)
    checked = 0
    client = ChatClient(served, timeout_s=60)
    for row in rows:
        body = generation_rows.request_body(params.generate, params.seed, "verifier", row) | {
            "return_token_ids": True
        }
        reply = client.chat(body)
        text = tokenizer.decode(reply.token_ids, skip_special_tokens=False)
        text = text.removesuffix(tokenizer.eos_token)
        if "</think>" not in text:
            continue
        assert generation_rows.split_reasoning(text) == (reply.reasoning, reply.content)
        checked += 1
        if checked == 3:
            break
    assert checked, "no reply reached </think>"

    # The rows keep what vLLM emitted: the turn's last id is the end-of-turn token when it
    # stopped, the text is those ids decoded, and the prompt ids are the template's rendering.
    for row in rows:
        ids = row["completion_token_ids"]
        assert ids and len(ids) <= params.generate.max_new_tokens
        ended = ids[-1] == tokenizer.eos_token_id
        assert ended == (row["finish_reason"] == "stop"), row["id"]
        text = tokenizer.decode(ids[:-1] if ended else ids, skip_special_tokens=False)
        assert text.endswith(row["content"]) and row["reasoning"] in text
        prompt = chat_template.render_prompt(tokenizer, row, params.generate.chat_template_kwargs)
        assert row["prompt_token_ids"] == tokenizer(prompt, add_special_tokens=False)["input_ids"]


@contextlib.contextmanager
def _throttled(upstream: str, refusals: int, retry_after_s: int) -> Iterator[tuple[str, list]]:
    """A proxy to `upstream`'s chat completions that answers its first `refusals` POSTs 429 with
    Retry-After, as a rate-limiting gateway in front of vLLM does; yields its URL and (time,
    status) per POST."""
    seen: list[tuple[float, int]] = []

    def respond(body: dict) -> tuple:
        if len(seen) < refusals:
            seen.append((time.monotonic(), 429))
            return error(429, "rate limited", retry_after_s=retry_after_s)
        resp = requests.post(f"{upstream}/v1/chat/completions", json=body, timeout=60)
        seen.append((time.monotonic(), resp.status_code))
        return resp.status_code, resp.json()

    with fake_servers() as start:
        yield start(respond).url, seen


@pytest.mark.vllm
def test_the_client_waits_out_429_then_reads_the_real_servers_reply(
    served: str, vllm_verifier: Path
) -> None:
    params = vllm_params(vllm_verifier, **SAMPLING)
    row = {"id": "q0", "messages": [{"role": "user", "content": "Say hi."}]}
    body = generation_rows.request_body(params.generate, params.seed, "verifier", row) | {
        "return_token_ids": True
    }
    with _throttled(served, refusals=1, retry_after_s=2) as (url, seen):
        client = ChatClient(url, timeout_s=60, max_retries=2)
        assert client.served_model("verifier") == "verifier"
        reply = client.chat(body)
    assert [status for _, status in seen] == [429, 200] and client.retries == 1
    assert seen[1][0] - seen[0][0] >= 1.9, "the server's Retry-After was not waited out"
    assert reply.token_ids and reply.completion_tokens == len(reply.token_ids)
    assert reply.prompt_token_ids and reply.reasoning is not None
    assert reply.finish_reason in ("stop", "length")


def _write_repo(root: Path, verifier: Path) -> list[str]:
    ids = prepare_rows(root, N_ROWS)
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
    rows = output_rows(tmp_path)
    assert sorted(r["id"] for r in rows) == ids
    assert all(
        set(r)
        == {
            "id",
            "split",
            "messages",
            "reasoning",
            "content",
            "finish_reason",
            "prompt_token_ids",
            "completion_token_ids",
            "row_key",  # what a grown prompt set reuses the row by (stages/generate.py)
        }
        for r in rows
    )
