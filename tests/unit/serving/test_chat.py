"""serving/chat.py: reply parsing, retries (429 and Retry-After too), cancellation, concurrency,
against a local stub. Against a real vLLM server: tests/integration/test_generate_vllm.py."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
from fake_openai import DROP, error, fake_servers, reply, row_id, sequence
from openai.types.chat import ChatCompletion

from eagle3_pipeline.core.errors import ServerError
from eagle3_pipeline.serving import chat as chat_client
from eagle3_pipeline.serving import server as vllm_server
from eagle3_pipeline.serving.chat import ChatClient, RequestFailed, complete_all, parse_reply

BODY = {"messages": [{"content": "x q0"}]}


@pytest.fixture
def fake() -> Iterator:
    with fake_servers() as start:
        yield start


def _completion(body: dict) -> ChatCompletion:
    return ChatCompletion.construct(**body)


def test_parse_reply_reads_reasoning_then_reasoning_content() -> None:
    choice = {"finish_reason": "length", "message": {"content": None, "reasoning": "r"}}
    assert parse_reply(_completion({"choices": [choice]})) == chat_client.ChatReply(
        "r", "", "length"
    )
    old = {"message": {"content": "c", "reasoning_content": "old"}, "finish_reason": "stop"}
    assert parse_reply(_completion({"choices": [old]})) == chat_client.ChatReply("old", "c", "stop")
    with pytest.raises(RequestFailed, match="malformed response"):
        parse_reply(_completion({"object": "error"}))


def test_vllm_extra_fields_reach_the_reply(fake) -> None:
    server = fake(sequence(reply(None, "text", "length", token_ids=[5, 6, 7], completion_tokens=3)))
    got = ChatClient(server.url).chat(BODY | {"return_token_ids": True, "top_k": 1})
    assert got == chat_client.ChatReply(None, "text", "length", [5, 6, 7], 3)
    assert server.bodies == [BODY | {"return_token_ids": True, "top_k": 1}], "body not sent as is"
    plain = ChatClient(server.url)
    server.respond = sequence(reply("r", "c"))
    assert plain.chat(BODY).token_ids is None and plain.chat(BODY).completion_tokens is None


def test_429_is_retried_after_the_servers_retry_after(fake) -> None:
    server = fake(sequence(error(429, "too many requests", retry_after_s=1), reply("r", "ok")))
    client = ChatClient(server.url, max_retries=2)
    t0 = time.monotonic()
    assert client.chat(BODY).content == "ok"
    assert time.monotonic() - t0 >= 0.95, "Retry-After: 1 was not honoured"
    assert len(server.bodies) == 2 and client.retries == 1


def test_5xx_and_dropped_connections_are_retried(fake, capsys) -> None:
    server = fake(sequence(error(503, "overloaded", 0.01), DROP, reply("why", "so")))
    client = ChatClient(server.url, max_retries=3, stage="gen")
    assert client.chat(BODY) == chat_client.ChatReply("why", "so", "stop")
    assert len(server.bodies) == 3 and client.retries == 2
    out = capsys.readouterr().out
    assert "retry 1/3: HTTP 503" in out and "retry 2/3: no answer" in out


def test_4xx_is_never_retried(fake) -> None:
    server = fake(sequence(error(400, "max_tokens is too large"), reply("r", "c")))
    client = ChatClient(server.url, max_retries=3)
    with pytest.raises(RequestFailed, match="^HTTP 400: max_tokens is too large$") as failed:
        client.chat(BODY)
    assert len(server.bodies) == 1 and client.retries == 0 and not failed.value.transient


def test_timeouts_are_retried(fake) -> None:
    calls = []

    def slow_first(body: dict) -> tuple[int, dict]:
        calls.append(1)
        if len(calls) == 1:
            time.sleep(1.0)
        return reply("r", "c")

    server = fake(slow_first)
    client = ChatClient(server.url, timeout_s=0.3, max_retries=2)
    assert client.chat(BODY).content == "c"
    assert len(server.bodies) == 2


def test_gives_up_after_max_retries_with_the_last_reason(fake) -> None:
    server = fake(sequence(error(500, "engine dead", retry_after_s=0.01)))
    client = ChatClient(server.url, max_retries=2)
    with pytest.raises(
        RequestFailed, match=r"^HTTP 500: engine dead \(gave up after 3 attempts\)$"
    ):
        client.chat(BODY)
    assert len(server.bodies) == 3


def test_connection_refused_is_retried_then_fails() -> None:
    client = ChatClient(f"http://127.0.0.1:{vllm_server.free_port()}", max_retries=1)
    with pytest.raises(RequestFailed, match="^connection error: .*gave up after 2 attempts") as e:
        client.chat({"messages": []})
    assert e.value.transient and "\n" not in str(e.value)


def test_a_cancelled_client_sends_no_further_attempt(fake) -> None:
    server = fake(sequence(error(503, "restarting", retry_after_s=1), reply("r", "c")))
    client = ChatClient(server.url, max_retries=3)
    threading.Timer(0.3, client.cancelled.set).start()  # during the backoff
    with pytest.raises(RequestFailed, match="^cancelled$"):
        client.chat(BODY)
    assert len(server.bodies) == 1
    assert client.served_model("verifier") == "verifier"  # what is served can still be asked


def test_served_model_names_a_missing_key(fake) -> None:
    server = fake(sequence(reply("r", "c")))
    assert ChatClient(server.url).served_model("verifier") == "verifier"
    server.models_status = 401
    with pytest.raises(ServerError, match="wants an API key and none was sent"):
        ChatClient(server.url).served_model("verifier")
    with pytest.raises(ServerError, match="a wrong one was sent"):
        ChatClient(server.url, api_key="k").served_model("verifier")
    assert not ChatClient(server.url).answers()


def test_complete_all_keeps_concurrency_requests_in_flight(fake) -> None:
    def slow(body: dict) -> tuple[int, dict]:
        time.sleep(0.05)
        return reply("r", row_id(body))

    server = fake(slow)
    client = ChatClient(server.url)
    outcomes: list[chat_client.Outcome] = []
    jobs = [(f"q{i}", {"messages": [{"content": f"x q{i}"}]}) for i in range(12)]
    complete_all(client, jobs, 3, outcomes.append)
    assert sorted(o.id for o in outcomes) == sorted(j[0] for j in jobs)
    assert all(o.reply is not None and o.reply.content == o.id for o in outcomes)
    assert 2 <= server.max_in_flight <= 3
