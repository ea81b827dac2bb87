"""serving/chat.py: reply parsing, retries and backoff, concurrency, against a local stub."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from fake_openai import DROP, error, fake_servers, reply, row_id, sequence

from eagle3_pipeline.serving import chat as chat_client
from eagle3_pipeline.serving import server as vllm_server
from eagle3_pipeline.serving.chat import ChatClient, RequestFailed, complete_all, parse_reply


@pytest.fixture
def fake() -> Iterator:
    with fake_servers() as start:
        yield start


def test_parse_reply_reads_reasoning_then_reasoning_content() -> None:
    choice = {"finish_reason": "length", "message": {"content": None, "reasoning": "r"}}
    assert parse_reply({"choices": [choice]}) == chat_client.ChatReply("r", "", "length")
    old = {"message": {"content": "c", "reasoning_content": "old"}, "finish_reason": "stop"}
    assert parse_reply({"choices": [old]}) == chat_client.ChatReply("old", "c", "stop")
    with pytest.raises(RequestFailed, match="malformed response"):
        parse_reply({"object": "error"})


def test_parse_reply_reads_token_ids_and_usage() -> None:
    _, body = reply(None, "text", "length", token_ids=[5, 6, 7], completion_tokens=3)
    got = parse_reply(body)
    assert got == chat_client.ChatReply(None, "text", "length", [5, 6, 7], 3)
    assert parse_reply(reply("r", "c")[1]).token_ids is None
    assert parse_reply(reply("r", "c")[1]).completion_tokens is None


def test_backoff_doubles_up_to_a_cap() -> None:
    client = ChatClient("http://127.0.0.1:1", backoff_s=1.0, max_backoff_s=5.0)
    assert [client.backoff(i) for i in range(5)] == [1.0, 2.0, 4.0, 5.0, 5.0]


def test_5xx_and_dropped_connections_are_retried(fake) -> None:
    server = fake(sequence(error(503, "overloaded"), DROP, reply("why", "so")))
    client = ChatClient(server.url, max_retries=3, backoff_s=0.01)
    assert client.chat({"messages": [{"content": "x q0"}]}) == chat_client.ChatReply(
        "why", "so", "stop"
    )
    assert len(server.bodies) == 3 and client.retries == 2


def test_4xx_is_never_retried(fake) -> None:
    server = fake(sequence(error(400, "max_tokens is too large"), reply("r", "c")))
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
        return reply("r", "c")

    server = fake(slow_first)
    client = ChatClient(server.url, timeout_s=0.3, max_retries=2, backoff_s=0.01)
    assert client.chat({"messages": [{"content": "x q0"}]}).content == "c"
    assert len(server.bodies) == 2


def test_gives_up_after_max_retries_with_the_last_reason(fake) -> None:
    server = fake(sequence(error(500, "engine dead")))
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
        return reply("r", row_id(body))

    server = fake(slow)
    client = ChatClient(server.url)
    outcomes: list[chat_client.Outcome] = []
    jobs = [(f"q{i}", {"messages": [{"content": f"x q{i}"}]}) for i in range(12)]
    complete_all(client, jobs, 3, outcomes.append)
    assert sorted(o.id for o in outcomes) == sorted(j[0] for j in jobs)
    assert all(o.reply is not None and o.reply.content == o.id for o in outcomes)
    assert 2 <= server.max_in_flight <= 3
