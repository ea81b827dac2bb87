"""generate, backend vllm.

Fast tests: the chat client's retries, backoff and concurrency, and the stage's failed-row
sidecar, against a scripted fake server on 127.0.0.1. Marked `vllm`: the stage against a real
vLLM server (reasoning split by its deepseek_r1 parser; resume after SIGKILL with no server left
behind). One server is shared by the module; the killed stage starts its own.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml

from eagle3_pipeline import atomic, resume
from eagle3_pipeline.errors import ServerError
from eagle3_pipeline.params import Params
from eagle3_pipeline.serving import chat as chat_client
from eagle3_pipeline.serving import server as vllm_server
from eagle3_pipeline.serving.chat import ChatClient, RequestFailed, complete_all, parse_reply
from eagle3_pipeline.stages import generate

DROP = "drop"  # a fake answer that closes the connection without a response
Respond = Callable[[dict[str, Any]], Any]

# ---------------------------------------------------------------------------------------------
# A scripted OpenAI-like server on loopback


class FakeServer:
    """Answers each POST with `respond(body)`: (status, json), or DROP to hang up."""

    def __init__(self, respond: Respond) -> None:
        self.respond = respond
        self.models_status = 200  # what GET /v1/models answers
        self.bodies: list[dict[str, Any]] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self._lock = threading.Lock()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.httpd.daemon_threads = True
        self.httpd.handle_error = lambda request, address: None  # a client that gave up
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, status: int, payload: Any) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                self._send(fake.models_status, {"object": "list", "data": [{"id": "verifier"}]})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with fake._lock:
                    fake.bodies.append(body)
                    fake.in_flight += 1
                    fake.max_in_flight = max(fake.max_in_flight, fake.in_flight)
                try:
                    answer = fake.respond(body)
                finally:
                    with fake._lock:
                        fake.in_flight -= 1
                if answer == DROP:
                    self.close_connection = True
                    return
                self._send(*answer)

        return Handler

    def requested_ids(self) -> list[str]:
        return [_row_id(b) for b in self.bodies]


@pytest.fixture
def fake() -> Iterator[Callable[[Respond], FakeServer]]:
    servers: list[FakeServer] = []

    def start(respond: Respond) -> FakeServer:
        server = FakeServer(respond)
        threading.Thread(target=server.httpd.serve_forever, args=(0.05,), daemon=True).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.httpd.shutdown()
        server.httpd.server_close()


def _reply(reasoning: str | None, content: str | None, finish: str = "stop") -> tuple[int, dict]:
    message = {"role": "assistant", "content": content, "reasoning": reasoning}
    return 200, {"choices": [{"index": 0, "message": message, "finish_reason": finish}]}


def _error(status: int, message: str) -> tuple[int, dict]:
    return status, {"error": {"message": message, "type": "Error", "code": status}}


def _row_id(body: dict[str, Any]) -> str:
    return body["messages"][0]["content"].split()[-1]


def _sequence(*answers: Any) -> Respond:
    """Answers in order, the last one repeated."""
    queue = list(answers)
    return lambda body: queue.pop(0) if len(queue) > 1 else queue[0]


# ---------------------------------------------------------------------------------------------
# chat client


def test_parse_reply_reads_reasoning_then_reasoning_content() -> None:
    choice = {"finish_reason": "length", "message": {"content": None, "reasoning": "r"}}
    assert parse_reply({"choices": [choice]}) == chat_client.ChatReply("r", "", "length")
    old = {"message": {"content": "c", "reasoning_content": "old"}, "finish_reason": "stop"}
    assert parse_reply({"choices": [old]}) == chat_client.ChatReply("old", "c", "stop")
    with pytest.raises(RequestFailed, match="malformed response"):
        parse_reply({"object": "error"})


def test_backoff_doubles_up_to_a_cap() -> None:
    client = ChatClient("http://127.0.0.1:1", backoff_s=1.0, max_backoff_s=5.0)
    assert [client.backoff(i) for i in range(5)] == [1.0, 2.0, 4.0, 5.0, 5.0]


def test_5xx_and_dropped_connections_are_retried(fake) -> None:
    server = fake(_sequence(_error(503, "overloaded"), DROP, _reply("why", "so")))
    client = ChatClient(server.url, max_retries=3, backoff_s=0.01)
    assert client.chat({"messages": [{"content": "x q0"}]}) == chat_client.ChatReply(
        "why", "so", "stop"
    )
    assert len(server.bodies) == 3 and client.retries == 2


def test_4xx_is_never_retried(fake) -> None:
    server = fake(_sequence(_error(400, "max_tokens is too large"), _reply("r", "c")))
    client = ChatClient(server.url, max_retries=3, backoff_s=0.01)
    with pytest.raises(RequestFailed, match="^HTTP 400: max_tokens is too large$"):
        client.chat({"messages": [{"content": "x q0"}]})
    assert len(server.bodies) == 1 and client.retries == 0


def test_timeouts_are_retried(fake) -> None:
    calls = []

    def slow_first(body: dict) -> tuple[int, dict]:
        calls.append(1)
        if len(calls) == 1:
            time.sleep(1.0)
        return _reply("r", "c")

    server = fake(slow_first)
    client = ChatClient(server.url, timeout_s=0.3, max_retries=2, backoff_s=0.01)
    assert client.chat({"messages": [{"content": "x q0"}]}).content == "c"
    assert len(server.bodies) == 2


def test_gives_up_after_max_retries_with_the_last_reason(fake) -> None:
    server = fake(_sequence(_error(500, "engine dead")))
    client = ChatClient(server.url, max_retries=2, backoff_s=0.01)
    with pytest.raises(RequestFailed, match=r"HTTP 500: engine dead \(gave up after 3 attempts"):
        client.chat({"messages": [{"content": "x q0"}]})
    assert len(server.bodies) == 3


def test_connection_refused_is_retried_then_fails() -> None:
    client = ChatClient(f"http://127.0.0.1:{vllm_server.free_port()}", max_retries=1, backoff_s=0)
    with pytest.raises(RequestFailed, match="connection error.*gave up after 2 attempts"):
        client.chat({"messages": []})


def test_complete_all_keeps_concurrency_requests_in_flight(fake) -> None:
    def slow(body: dict) -> tuple[int, dict]:
        time.sleep(0.05)
        return _reply("r", _row_id(body))

    server = fake(slow)
    client = ChatClient(server.url)
    outcomes: list[chat_client.Outcome] = []
    jobs = [(f"q{i}", {"messages": [{"content": f"x q{i}"}]}) for i in range(12)]
    complete_all(client, jobs, 3, outcomes.append)
    assert sorted(o.id for o in outcomes) == sorted(j[0] for j in jobs)
    assert all(o.reply is not None and o.reply.content == o.id for o in outcomes)
    assert 2 <= server.max_in_flight <= 3


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
    return atomic.read_jsonl(out / "train.jsonl") + atomic.read_jsonl(out / "val.jsonl")


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
            return _error(400, "prompt is too long")
        if rid == "q05":
            return _error(500, "engine hiccup")
        return healthy(body)

    server = fake(flaky)
    params = _params(_fake_verifier(tmp_path), server_url=server.url, max_retries=1)
    monkeypatch.setattr(ChatClient, "backoff", lambda self, attempt: 0.01)
    generate.run(params)

    failed = atomic.read_jsonl(tmp_path / "data/generated/failed.jsonl")
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
    assert atomic.read_jsonl(tmp_path / "data/generated/failed.jsonl") == []


def test_stage_where_every_request_fails_is_an_error(tmp_path: Path, fake, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    _prepare(tmp_path, 4)
    server = fake(_sequence(_error(400, "max_tokens=4000 cannot be greater than max_model_len")))
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


def test_unreachable_server_url_is_a_one_line_error(tmp_path: Path, monkeypatch) -> None:
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
