"""Online evaluation: the verifier served by vLLM with and without the drafter, on val prompts.

The offline simulation can agree with itself and still disagree with vLLM (layer ids, vocab
mapping, norm flags, another verifier): only vLLM's own counters show that drafts are accepted.
The run without speculation is the throughput baseline and, at temperature 0, the reference
output that speculative decoding must reproduce: both runs request top-k logprobs, so that a
divergence can be judged as vLLM judges its own (evaluation/losslessness.py).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import requests

from eagle3_pipeline.errors import ServerError
from eagle3_pipeline.evaluation import draft_sweep
from eagle3_pipeline.evaluation import losslessness as lossless
from eagle3_pipeline.evaluation.acceptance import served_acceptance, served_row
from eagle3_pipeline.serving.chat import (
    ChatClient,
    ChatReply,
    Outcome,
    RequestFailed,
    complete_all,
    parse_reply,
)
from eagle3_pipeline.serving.server import ServerSpec, metrics, serve, serve_many
from eagle3_pipeline.serving.server_spec import SERVED_NAME

SPEC_PREFIX = "vllm:spec_decode_"
_KEY = re.compile(r"^(?P<name>[^{\s]+)(?:\{(?P<labels>.*)\})?$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')

Messages = list[dict[str, Any]]


@dataclass(frozen=True)
class Settings:
    """How prompts are sent; identical for both runs so that throughputs compare."""

    num_speculative_tokens: int
    max_new_tokens: int
    concurrency: int = 1
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    request_timeout_s: float = 600.0
    max_retries: int = 4  # transient failures (no answer, 5xx), as chat.py retries them
    served_model_name: str = SERVED_NAME
    top_logprobs: int = 5  # per generated token, for the losslessness verdict
    near_tie_nats: float = 0.1  # evaluate.near_tie_nats (params.py)
    # evaluate.throughput_concurrency: each server timed again on the same prompts at these
    throughput_concurrency: tuple[int, ...] = ()


@dataclass
class RunResult:
    """Outputs of one server run and the spec-decode counter deltas over its request phase."""

    token_ids: list[list[int]]
    texts: list[str]
    num_tokens: list[int]
    wall_s: float
    counters: dict[str, float]
    logprobs: list[list[lossless.TokenLogprobs] | None] = field(default_factory=list)
    # further concurrency -> (output tokens, wall seconds, counter deltas) of the same prompts
    by_concurrency: dict[int, tuple[int, float, dict[str, float]]] = field(default_factory=dict)

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


def read_counters(url: str, k: int) -> dict[str, float]:
    """Spec-decode counters plus generated tokens; a /metrics failure is one ServerError line."""
    try:
        values = metrics(url)
    except requests.RequestException as exc:
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
    returned so outputs compare fully."""
    return {
        "model": settings.served_model_name,
        "messages": messages,
        "temperature": 0.0,
        "max_tokens": max_tokens or settings.max_new_tokens,
        "chat_template_kwargs": settings.chat_template_kwargs,
        "skip_special_tokens": False,
        "return_token_ids": True,
        "logprobs": True,
        "top_logprobs": settings.top_logprobs,
        "return_tokens_as_token_ids": True,
    }


@dataclass(frozen=True)
class ScoredReply(ChatReply):
    """A chat reply with its generated tokens' logprobs (None: the server sent none)."""

    logprobs: list[lossless.TokenLogprobs] | None = None


class ScoringClient(ChatClient):
    """The chat client, keeping the logprobs that `parse_reply` leaves out."""

    def chat(self, body: dict[str, Any]) -> ScoredReply:
        response = self.post("/v1/chat/completions", body)
        reply = parse_reply(response)
        lp = lossless.parse_logprobs(response["choices"][0])
        return ScoredReply(**{f.name: getattr(reply, f.name) for f in fields(reply)}, logprobs=lp)


Completion = tuple[list[int], str, int, list[lossless.TokenLogprobs] | None]


def client(url: str, settings: Settings) -> ChatClient:
    return ScoringClient(url, settings.request_timeout_s, settings.max_retries, stage="evaluate")


def completion(reply: ChatReply, url: str) -> Completion:
    """(token ids, text, token count, logprobs); the text is reasoning + content (the server is
    started without a reasoning parser, so reasoning is normally None)."""
    if reply.completion_tokens is None:
        raise ServerError(f"{url}: a chat completion without usage.completion_tokens")
    text = (reply.reasoning or "") + reply.content
    logprobs = reply.logprobs if isinstance(reply, ScoredReply) else None
    return list(reply.token_ids or []), text, reply.completion_tokens, logprobs


def complete(chat: ChatClient, payload: dict) -> Completion:
    """One chat completion, retried by the client; a failure is one ServerError line."""
    try:
        reply = chat.chat(payload)
    except RequestFailed as exc:
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
    """Warm the server with one short request, then time the prompts and diff the counters;
    again at each of `settings.throughput_concurrency` (outputs kept from the first run)."""
    complete(client(url, settings), chat_payload(conversations[0], settings, max_tokens=4))
    k = settings.num_speculative_tokens
    before = settled_counters(url, k)
    results, wall = run_prompts(url, conversations, settings)
    after = settled_counters(url, k)
    counters = delta(before, after) | {"spec_decode_enabled": after["spec_decode_enabled"]}
    ids, texts, counts, logprobs = (list(x) for x in zip(*results, strict=True))
    run = RunResult(ids, texts, counts, wall, counters, logprobs)
    for c in settings.throughput_concurrency:
        if c == settings.concurrency or c in run.by_concurrency:
            continue
        before = settled_counters(url, k)
        again, wall_c = run_prompts(url, conversations, replace(settings, concurrency=c))
        run.by_concurrency[c] = (
            sum(n for _, _, n, _ in again),
            wall_c,
            delta(before, settled_counters(url, k)),
        )
    return run


Runner = Callable[[ServerSpec, Sequence[Messages], Settings], RunResult]


def serve_and_measure(
    spec: ServerSpec, conversations: Sequence[Messages], settings: Settings
) -> RunResult:
    with serve(spec) as url:
        return measure(url, conversations, settings)


def serve_together_and_measure(
    specs: tuple[ServerSpec, ServerSpec], conversations: Sequence[Messages], settings: Settings
) -> tuple[RunResult, RunResult]:
    """Both servers started at once (one start-up's wait), then measured one after the other:
    the idle one takes no requests while the other is timed."""
    with serve_many(list(specs)) as (first, second):
        return measure(first, conversations, settings), measure(second, conversations, settings)


# --- both runs -------------------------------------------------------------------------------


def speculative_config(drafter: str | Path, k: int, family: str = "eagle3") -> dict[str, Any]:
    """vLLM's speculative config for a drafter of `family` (drafter.families).

    The method is always named: without one vLLM guesses it from the folder's name and
    otherwise serves the drafter as a draft model, whose every request then fails. P-EAGLE is
    EAGLE-3's method with parallel drafting (else vLLM drafts with it chained and skips its
    mask_hidden weights); EAGLE-3.1 is EAGLE-3's method, its norms read from the drafter's
    config; DFlash is its own method.
    """
    config: dict[str, Any] = {"model": str(drafter), "num_speculative_tokens": k}
    if family == "dflash":
        return {"method": "dflash"} | config
    return (
        {"method": "eagle3"} | config | ({"parallel_drafting": True} if family == "peagle" else {})
    )


def server_specs(
    base: ServerSpec, drafter: str | Path, k: int, log_dir: Path, family: str = "eagle3"
) -> tuple[ServerSpec, ServerSpec]:
    """(baseline, speculative) variants of one server spec; only the drafter differs."""
    baseline = replace(base, speculative_config=None, log_file=log_dir / "vllm-baseline.log")
    spec = replace(
        base,
        speculative_config=speculative_config(drafter, k, family),
        log_file=log_dir / f"vllm-{family}.log",
    )
    return baseline, spec


def mismatched_prompts(a: RunResult, b: RunResult) -> list[int]:
    """Indices of prompts whose greedy outputs differ (token ids, or text if ids are missing)."""
    return [
        i
        for i, (ta, tb, xa, xb) in enumerate(
            zip(a.token_ids, b.token_ids, a.texts, b.texts, strict=True)
        )
        if (ta != tb if ta and tb else xa != xb)
    ]


def verdict(
    prompt_ids: Sequence[str], baseline: RunResult, spec: RunResult, settings: Settings
) -> lossless.Verdict:
    """The losslessness verdict of the two runs (evaluation/losslessness.py)."""
    n = len(prompt_ids)
    for run in (baseline, spec):
        if len(run.token_ids) != n or not all(
            run.token_ids[i] or not run.texts[i] for i in range(n)
        ):
            raise ServerError(
                "vLLM returned no token_ids for a completion (requested with return_token_ids): "
                "the outputs cannot be compared token by token"
            )

    def logprobs(run: RunResult) -> list:
        return list(run.logprobs) + [None] * (n - len(run.logprobs))

    return lossless.judge(
        prompt_ids,
        baseline.token_ids,
        spec.token_ids,
        logprobs(baseline),
        logprobs(spec),
        settings.near_tie_nats,
        settings.top_logprobs,
    )


def online_section(
    baseline: RunResult, spec: RunResult, k: int, concurrency: int | None = None
) -> dict[str, Any]:
    """The `online` block of metrics/eval.json; `by_concurrency` (keyed by the concurrency as
    a string) when the servers were timed at more than one."""
    speedup = spec.tokens_per_s / baseline.tokens_per_s if baseline.tokens_per_s else 0.0
    section = {
        "num_prompts": len(spec.texts),
        **served_acceptance(spec.counters, k),
        "output_tokens": spec.output_tokens,
        "output_tokens_baseline": baseline.output_tokens,
        "tokens_per_s": spec.tokens_per_s,
        "tokens_per_s_baseline": baseline.tokens_per_s,
        "speedup": speedup,
    }
    more = sorted(set(spec.by_concurrency) & set(baseline.by_concurrency))
    if more:
        by = {}
        if concurrency is not None:
            by[str(concurrency)] = served_row(
                spec.output_tokens,
                spec.wall_s,
                baseline.output_tokens,
                baseline.wall_s,
                spec.counters,
                k,
            )
        for c in more:
            tokens, wall, counters = spec.by_concurrency[c]
            tokens_base, wall_base, _ = baseline.by_concurrency[c]
            by[str(c)] = served_row(tokens, wall, tokens_base, wall_base, counters, k)
        section["by_concurrency"] = by
    return section


def evaluate(
    base: ServerSpec,
    drafter: str | Path,
    conversations: Sequence[Messages],
    settings: Settings,
    log_dir: Path,
    runner: Runner | None = None,
    prompt_ids: Sequence[str] | None = None,
    start_together: bool = False,
    family: str = "eagle3",
    sweep: Sequence[int] = (),
) -> tuple[dict[str, Any], list[int], lossless.Verdict]:
    """Serve without, then with the drafter; (online section, indices of differing outputs,
    losslessness verdict naming prompts by `prompt_ids`, default their indices).

    Measured one after the other, never side by side: two servers busy on the same cores would
    skew the throughputs. `start_together` starts both servers at once (where memory holds two)
    and measures them in turn. `runner` replaces `serve_and_measure` (tests record the servers
    they start). `sweep`: further draft counts, the drafter served again at each
    (evaluation.draft_sweep).
    """
    if not conversations:
        raise ValueError("online evaluation needs at least one prompt")
    k = settings.num_speculative_tokens
    baseline_spec, eagle_spec = server_specs(base, drafter, k, log_dir, family)
    if start_together and runner is None:
        baseline, spec = serve_together_and_measure(
            (baseline_spec, eagle_spec), conversations, settings
        )
    else:
        runner = runner or serve_and_measure
        baseline = runner(baseline_spec, conversations, settings)
        spec = runner(eagle_spec, conversations, settings)
    if not spec.counters.get("spec_decode_enabled"):
        raise ServerError(
            f"vLLM was started with the drafter but its /metrics has no {SPEC_PREFIX}* "
            f"counters: speculative decoding is off; see {eagle_spec.log_file}"
        )
    runs = {k: spec}
    for n in (n for n in sweep if n not in runs):
        _, at_n = server_specs(base, drafter, n, log_dir, family)
        at_n = replace(at_n, log_file=log_dir / f"vllm-{family}-k{n}.log")
        sweep_settings = replace(settings, num_speculative_tokens=n, throughput_concurrency=())
        runs[n] = (runner or serve_and_measure)(at_n, conversations, sweep_settings)
    names = list(prompt_ids) if prompt_ids is not None else [str(i) for i in range(len(spec.texts))]
    section = online_section(baseline, spec, k, settings.concurrency)
    return (
        section | draft_sweep.section(baseline, runs),
        mismatched_prompts(baseline, spec),
        verdict(names, baseline, spec, settings),
    )
