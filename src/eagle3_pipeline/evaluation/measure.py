"""Measuring one vLLM server: its spec-decode counters, the requests sent to it, a timed pass.

`measure` warms the server with one short request, sends every prompt (`concurrency` at a time,
greedy, token ids and top-k logprobs returned, so that outputs compare fully: see
evaluation/losslessness.py) and diffs vLLM's Prometheus counters around the pass, once two reads
agree. evaluation/online.py serves the verifier with and without the drafter and compares the two
measured this way.

`Settings` are identical for both runs so that throughputs compare; the knobs params.yaml sets
(`evaluate.*`) default to params' own defaults (`Settings.of` is what the stage uses).
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import requests

from eagle3_pipeline.config.params import EvaluateParams
from eagle3_pipeline.core.errors import ServerDown, ServerError
from eagle3_pipeline.evaluation import losslessness as lossless
from eagle3_pipeline.evaluation import served
from eagle3_pipeline.serving.chat import (
    ChatClient,
    ChatReply,
    Outcome,
    RequestFailed,
    complete_all,
    parse_reply,
)
from eagle3_pipeline.serving.server import metrics
from eagle3_pipeline.serving.server_process import HEALTH_FAILURES, WATCH_INTERVAL_S, down_reason
from eagle3_pipeline.serving.server_spec import SERVED_NAME

SPEC_PREFIX = "vllm:spec_decode_"
_KEY = re.compile(r"^(?P<name>[^{\s]+)(?:\{(?P<labels>.*)\})?$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')

Messages = list[dict[str, Any]]


# The defaults of the knobs params.yaml sets are params' own: one default per knob.
_EVALUATE = EvaluateParams()


@dataclass(frozen=True)
class Settings:
    """How prompts are sent; identical for both runs so that throughputs compare."""

    num_speculative_tokens: int
    max_new_tokens: int
    concurrency: int = _EVALUATE.concurrency
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    request_timeout_s: float = 600.0
    max_retries: int = 4  # transient failures (no answer, 5xx), as chat.py retries them
    served_model_name: str = SERVED_NAME
    # per generated token, for the losslessness verdict; 0: none asked (the timing rounds)
    top_logprobs: int = _EVALUATE.top_logprobs
    near_tie_nats: float = _EVALUATE.near_tie_nats
    # evaluate.throughput_concurrency: the pair timed again in rounds at these concurrencies
    throughput_concurrency: tuple[int, ...] = tuple(_EVALUATE.throughput_concurrency)
    speedup_rounds: int = _EVALUATE.speedup_rounds  # paired rounds per concurrency
    speedup_max_spread: float = _EVALUATE.speedup_max_spread  # evaluation/speedup.py

    @classmethod
    def of(cls, e: EvaluateParams, chat_template_kwargs: dict[str, Any]) -> Settings:
        """The settings of the `evaluate` stage (and every `family_eval@NAME`): params'
        `evaluate` section, and generate's chat template kwargs."""
        return cls(
            num_speculative_tokens=e.num_speculative_tokens,
            max_new_tokens=e.max_new_tokens,
            # Both runs use it, so the ratio is fair; 1 = the latency a single user sees.
            concurrency=e.concurrency,
            chat_template_kwargs=dict(chat_template_kwargs),
            top_logprobs=e.top_logprobs,
            near_tie_nats=e.near_tie_nats,
            throughput_concurrency=tuple(e.throughput_concurrency),
            speedup_rounds=e.speedup_rounds,
            speedup_max_spread=e.speedup_max_spread,
        )


@dataclass
class RunResult:
    """Outputs of one server run and the spec-decode counter deltas over its request phase."""

    token_ids: list[list[int]]
    texts: list[str]
    num_tokens: list[int]
    wall_s: float
    counters: dict[str, float]
    logprobs: list[list[lossless.TokenLogprobs] | None] = field(default_factory=list)
    # vLLM's (accepted, drafted) per verify step of each answer (evaluation/served.py); None
    # where the server sent none
    steps: list[tuple[list[int], list[int]] | None] = field(default_factory=list)
    finish_reasons: list[str] = field(default_factory=list)

    def answers(self, categories: Sequence[str] | None = None) -> list[served.Answer]:
        """The answers with vLLM's step counts (served.Answer), in prompt order; a ServerError
        when one has none (the server was not started with served.SPEC_METRICS_ARGS)."""
        out = []
        for i, (ids, steps) in enumerate(zip(self.token_ids, self.steps, strict=True)):
            if steps is None:
                raise ServerError(
                    f"answer {i}: vLLM sent no per-step spec-decode counts (metrics."
                    "speculative_decoding.per_step_accepted): start it with "
                    + " ".join(served.SPEC_METRICS_ARGS)
                )
            category = categories[i] if categories is not None else ""
            cut = self.finish_reasons[i] == "length"
            out.append(served.Answer(ids, steps[0], steps[1], cut, category))
        return out

    @property
    def output_tokens(self) -> int:
        return sum(self.num_tokens)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else 0.0


# --- Prometheus counters ---------------------------------------------------------------------


def split_key(key: str) -> tuple[str, dict[str, str]]:
    """`name{a="x",b="y"}` -> (name, {a: x, b: y}), as `server.metrics` keys them."""
    m = _KEY.match(key.strip())
    if m is None:
        return key, {}
    return m["name"], dict(_LABEL.findall(m["labels"] or ""))


def counter(values: dict[str, float], name: str, **labels: str) -> float:
    """Sum of a counter over all label sets that contain `labels` (engines, models)."""
    total = 0.0
    for key, value in values.items():
        got, got_labels = split_key(key)
        if got == name and all(got_labels.get(k) == v for k, v in labels.items()):
            total += value
    return total


def spec_counters(values: dict[str, float], k: int) -> dict[str, float]:
    """vLLM's spec-decode counters (Prometheus `_total` names) as flat totals."""
    out = {
        "num_drafts": counter(values, f"{SPEC_PREFIX}num_drafts_total"),
        "num_draft_tokens": counter(values, f"{SPEC_PREFIX}num_draft_tokens_total"),
        "num_accepted_tokens": counter(values, f"{SPEC_PREFIX}num_accepted_tokens_total"),
    }
    for pos in range(k):
        name = f"{SPEC_PREFIX}num_accepted_tokens_per_pos_total"
        out[f"accepted_pos_{pos}"] = counter(values, name, position=str(pos))
    return out


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {key: after[key] - before.get(key, 0.0) for key in after}


# How long a failed /metrics read waits for the server's watch to say it stopped.
DOWN_VERDICT_S = (HEALTH_FAILURES + 2) * WATCH_INTERVAL_S


def read_counters(url: str, k: int) -> dict[str, float]:
    """Spec-decode counters plus generated tokens; a /metrics failure is one ServerError line."""
    try:
        values = metrics(url)
    except requests.RequestException as exc:
        # A server just killed refuses before its watch has told why: wait for the verdict.
        if why := down_reason(url, wait_s=DOWN_VERDICT_S):
            raise ServerDown(why) from None
        raise ServerError(f"{url}/metrics: not readable: {exc}") from None
    out = spec_counters(values, k)
    out["generation_tokens"] = counter(values, "vllm:generation_tokens_total")
    out["spec_decode_enabled"] = float(
        any(split_key(key)[0] == f"{SPEC_PREFIX}num_drafts_total" for key in values)
    )
    return out


def settled_counters(url: str, k: int, timeout_s: float = 10.0) -> dict[str, float]:
    """Counters once two reads agree: the last step's stats may land just after the response."""
    last = read_counters(url, k)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = read_counters(url, k)
        if now == last:
            return now
        last = now
    return last


# --- requests --------------------------------------------------------------------------------


def chat_payload(messages: Messages, settings: Settings, max_tokens: int | None = None) -> dict:
    """Greedy chat request; special tokens kept, token ids and top-k logprobs (tokens as ids)
    returned so outputs compare fully. `settings.top_logprobs` 0: no logprobs asked (a timing
    round: a user's request, without the verdict's extra work per token)."""
    payload = {
        "model": settings.served_model_name,
        "messages": messages,
        "temperature": 0.0,
        "max_tokens": max_tokens or settings.max_new_tokens,
        "chat_template_kwargs": settings.chat_template_kwargs,
        "skip_special_tokens": False,
        "return_token_ids": True,
    }
    if settings.top_logprobs:
        payload |= {
            "logprobs": True,
            "top_logprobs": settings.top_logprobs,
            "return_tokens_as_token_ids": True,
        }
    return payload


@dataclass(frozen=True)
class ScoredReply(ChatReply):
    """A chat reply with its generated tokens' logprobs (None: the server sent none)."""

    logprobs: list[lossless.TokenLogprobs] | None = None
    steps: tuple[list[int], list[int]] | None = None


class ScoringClient(ChatClient):
    """The chat client, keeping the logprobs and vLLM's per-step spec-decode counts that
    `parse_reply` leaves out."""

    def chat(self, body: dict[str, Any]) -> ScoredReply:
        response = self.post("/chat/completions", body)
        reply = parse_reply(response)
        lp = lossless.parse_logprobs(response.choices[0].to_dict())
        steps = served.step_counts(getattr(response, "metrics", None))
        return ScoredReply(
            **{f.name: getattr(reply, f.name) for f in fields(reply)}, logprobs=lp, steps=steps
        )


@dataclass(frozen=True)
class Completion:
    """One answer as the runs compare it."""

    token_ids: list[int]
    text: str
    num_tokens: int
    logprobs: list[lossless.TokenLogprobs] | None
    steps: tuple[list[int], list[int]] | None
    finish_reason: str


def client(url: str, settings: Settings) -> ChatClient:
    return ScoringClient(url, settings.request_timeout_s, settings.max_retries, stage="evaluate")


def completion(reply: ChatReply, url: str) -> Completion:
    """The answer; its text is reasoning + content (the server is started without a reasoning
    parser, so reasoning is normally None)."""
    if reply.completion_tokens is None:
        raise ServerError(f"{url}: a chat completion without usage.completion_tokens")
    text = (reply.reasoning or "") + reply.content
    scored = isinstance(reply, ScoredReply)
    return Completion(
        list(reply.token_ids or []),
        text,
        reply.completion_tokens,
        reply.logprobs if scored else None,
        reply.steps if scored else None,
        reply.finish_reason,
    )


def complete(chat: ChatClient, payload: dict) -> Completion:
    """One chat completion, retried by the client; a failure is one ServerError line."""
    try:
        reply = chat.chat(payload)
    except RequestFailed as exc:
        if exc.down:
            raise ServerDown(str(exc)) from None
        raise ServerError(f"{chat.base_url}: chat completion failed: {exc}") from None
    return completion(reply, chat.base_url)


def run_prompts(
    url: str, conversations: Sequence[Messages], settings: Settings
) -> tuple[list[Completion], float]:
    """Send all prompts, `concurrency` at a time; (completions in prompt order, wall seconds).

    The first prompt that fails for good stops the run (the others are cancelled).
    """
    jobs = [(str(i), chat_payload(m, settings)) for i, m in enumerate(conversations)]
    done: dict[int, Completion] = {}

    def on_outcome(out: Outcome) -> None:
        if out.reply is None:
            raise ServerError(f"{url}: chat completion failed: {out.error}")
        done[int(out.id)] = completion(out.reply, url)

    t0 = time.monotonic()
    complete_all(client(url, settings), jobs, settings.concurrency, on_outcome)
    return [done[i] for i in range(len(jobs))], time.monotonic() - t0


def measure(url: str, conversations: Sequence[Messages], settings: Settings) -> RunResult:
    """Warm the server with one short request, then time the prompts and diff the counters."""
    complete(client(url, settings), chat_payload(conversations[0], settings, max_tokens=4))
    k = settings.num_speculative_tokens
    before = settled_counters(url, k)
    results, wall = run_prompts(url, conversations, settings)
    after = settled_counters(url, k)
    counters = delta(before, after) | {"spec_decode_enabled": after["spec_decode_enabled"]}
    return RunResult(
        [c.token_ids for c in results],
        [c.text for c in results],
        [c.num_tokens for c in results],
        wall,
        counters,
        [c.logprobs for c in results],
        [c.steps for c in results],
        [c.finish_reason for c in results],
    )
