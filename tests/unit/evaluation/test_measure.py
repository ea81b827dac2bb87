"""evaluation/measure.py without vLLM: counters, acceptance from their deltas, requests (through
serving/chat.py against a local stub)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import pytest
from fake_openai import error, fake_servers, reply, row_id, sequence

from eagle3_pipeline.core.errors import ServerError
from eagle3_pipeline.evaluation import measure
from eagle3_pipeline.evaluation.acceptance import served_acceptance
from eagle3_pipeline.evaluation.losslessness import TokenLogprobs

K = 3
SETTINGS = measure.Settings(num_speculative_tokens=K, max_new_tokens=24, concurrency=2)
CONVERSATIONS = [[{"role": "user", "content": f"question q{i}"}] for i in range(6)]


@pytest.fixture
def fake() -> Iterator:
    with fake_servers() as start:
        yield start


# --- counters --------------------------------------------------------------------------------


def _metrics(drafts: float, accepted_pos: list[float], engines: int = 1) -> dict[str, float]:
    """/metrics as server.metrics returns it, for `engines` engines with equal counts."""
    out: dict[str, float] = {}
    for e in range(engines):
        lab = f'engine="{e}",model_name="verifier"'
        out[f"vllm:spec_decode_num_drafts_total{{{lab}}}"] = drafts
        out[f"vllm:spec_decode_num_drafts_created{{{lab}}}"] = 1.7e9
        out[f"vllm:spec_decode_num_draft_tokens_total{{{lab}}}"] = drafts * len(accepted_pos)
        out[f"vllm:spec_decode_num_accepted_tokens_total{{{lab}}}"] = sum(accepted_pos)
        for p, a in enumerate(accepted_pos):
            key = f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{lab},position="{p}"}}'
            out[key] = a
    return out


def test_spec_counters_sum_engines_and_skip_created() -> None:
    counts = measure.spec_counters(_metrics(10, [8, 4, 2], engines=2), K)
    assert counts == {
        "num_drafts": 20,
        "num_draft_tokens": 60,
        "num_accepted_tokens": 28,
        "accepted_pos_0": 16,
        "accepted_pos_1": 8,
        "accepted_pos_2": 4,
    }


def test_acceptance_from_counter_deltas() -> None:
    before = measure.spec_counters(_metrics(5, [5, 5, 5]), K)
    after = measure.spec_counters(_metrics(15, [13, 9, 7]), K)
    result = served_acceptance(measure.delta(before, after), K)
    assert result["num_drafts"] == 10 and result["num_draft_tokens"] == 30
    assert result["acceptance_rate"] == pytest.approx(14 / 30)
    assert result["mean_acceptance_length"] == pytest.approx(1 + 14 / 10)
    assert result["acceptance_per_position"] == pytest.approx([0.8, 0.4, 0.2])


def test_acceptance_without_drafts_is_neutral() -> None:
    result = served_acceptance(measure.spec_counters({}, K), K)
    assert result["mean_acceptance_length"] == 1.0 and result["acceptance_rate"] == 0.0


def test_split_key_reads_labels() -> None:
    name, labels = measure.split_key('vllm:x_total{engine="0",model_name="a b",position="2"}')
    assert name == "vllm:x_total"
    assert labels == {"engine": "0", "model_name": "a b", "position": "2"}
    assert measure.split_key("plain 1") == ("plain 1", {})
    assert measure.split_key("plain") == ("plain", {})


# --- requests --------------------------------------------------------------------------------


def _answer(body: dict) -> tuple[int, dict]:
    """A greedy reply whose tokens encode the prompt's id (q3 -> [3, 3])."""
    n = int(row_id(body)[1:])
    return reply(None, f"answer {n}", token_ids=[n, n], completion_tokens=2)


def test_payload_is_greedy_with_token_ids_and_logprobs() -> None:
    payload = measure.chat_payload(CONVERSATIONS[0], SETTINGS)
    assert payload == {
        "model": "verifier",
        "messages": CONVERSATIONS[0],
        "temperature": 0.0,
        "max_tokens": 24,
        "chat_template_kwargs": {},
        "skip_special_tokens": False,
        "return_token_ids": True,
        "logprobs": True,
        "top_logprobs": 5,
        "return_tokens_as_token_ids": True,
    }
    assert measure.chat_payload(CONVERSATIONS[0], SETTINGS, max_tokens=4)["max_tokens"] == 4


def test_run_prompts_keeps_prompt_order_and_concurrency(fake) -> None:
    server = fake(_answer)
    results, wall = measure.run_prompts(server.url, CONVERSATIONS, SETTINGS)
    assert results == [
        measure.Completion([i, i], f"answer {i}", 2, None, None, "stop")
        for i in range(len(CONVERSATIONS))
    ]
    assert wall > 0 and server.max_in_flight <= SETTINGS.concurrency
    assert sorted(server.requested_ids()) == [f"q{i}" for i in range(len(CONVERSATIONS))]


def test_transient_failures_are_retried(fake) -> None:
    server = fake(
        sequence(
            error(503, "overloaded", 0.01), reply("r", "c", token_ids=[1], completion_tokens=1)
        )
    )
    got = measure.complete(measure.client(server.url, SETTINGS), {"messages": []})
    assert got == measure.Completion([1], "rc", 1, None, None, "stop")
    assert len(server.bodies) == 2


def test_a_prompt_that_fails_for_good_is_one_server_error(fake) -> None:
    server = fake(sequence(error(400, "prompt is too long")))
    with pytest.raises(ServerError, match="chat completion failed: HTTP 400: prompt is too long"):
        measure.run_prompts(server.url, CONVERSATIONS, SETTINGS)


def test_logprobs_are_kept_with_token_ids(fake) -> None:
    status, body = reply(None, "ab", token_ids=[7, 9], completion_tokens=2)
    body["choices"][0]["logprobs"] = {
        "content": [
            {
                "token": "token_id:7",
                "logprob": -0.1,
                "top_logprobs": [
                    {"token": "token_id:7", "logprob": -0.1},
                    {"token": "token_id:3", "logprob": -2.5},
                ],
            },
            {
                "token": "token_id:9",
                "logprob": -0.7,
                "top_logprobs": [{"token": "token_id:9", "logprob": -0.7}],
            },
        ]
    }
    server = fake(sequence((status, body)))
    got = measure.complete(measure.client(server.url, SETTINGS), {"messages": []})
    assert (got.token_ids, got.text, got.num_tokens) == ([7, 9], "ab", 2)
    assert got.logprobs == [
        TokenLogprobs(7, -0.1, {7: -0.1, 3: -2.5}),
        TokenLogprobs(9, -0.7, {9: -0.7}),
    ]


def test_reply_without_usage_is_a_server_error(fake) -> None:
    server = fake(sequence(reply(None, "c", token_ids=[1])))
    with pytest.raises(ServerError, match="without usage.completion_tokens"):
        measure.complete(measure.client(server.url, SETTINGS), {"messages": []})


def test_request_failure_is_one_line_server_error() -> None:
    settings = measure.Settings(num_speculative_tokens=K, max_new_tokens=4, max_retries=0)
    with pytest.raises(ServerError, match="chat completion failed"):
        measure.complete(
            measure.client("http://127.0.0.1:9", settings),
            measure.chat_payload(CONVERSATIONS[0], settings),
        )


def test_timing_rounds_ask_no_logprobs() -> None:
    """A round's requests are a user's; only the full passes ask logprobs for the verdict."""
    payload = measure.chat_payload(CONVERSATIONS[0], replace(SETTINGS, top_logprobs=0))
    assert not {"logprobs", "top_logprobs", "return_tokens_as_token_ids"} & set(payload)
    assert payload["return_token_ids"] is True and payload["temperature"] == 0.0


def test_vllm_step_counts_are_kept_per_answer(fake) -> None:
    """vLLM's per-request spec-decode counts (served.SPEC_METRICS_ARGS) reach the answer."""
    status, body = reply(None, "abcd", finish="length", token_ids=[1, 2, 3, 4], completion_tokens=4)
    body["metrics"] = {
        "speculative_decoding": {
            "num_spec_tokens": 3,
            "per_step_accepted": [2, 0],
            "per_step_drafted": [3, 3],
        }
    }
    server = fake(sequence((status, body)))
    got = measure.complete(measure.client(server.url, SETTINGS), {"messages": []})
    assert got.steps == ([2, 0], [3, 3]) and got.finish_reason == "length"
