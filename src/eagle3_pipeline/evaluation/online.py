"""Online evaluation: the verifier served by vLLM with and without the drafter, on val prompts.

The offline simulation can agree with itself and still disagree with vLLM (layer ids, vocab
mapping, norm flags, another verifier): only vLLM's own counters show that drafts are accepted.
The run without speculation is the throughput baseline and, at temperature 0, the reference
output that speculative decoding must reproduce: both runs request top-k logprobs, so that a
divergence can be judged as vLLM judges its own (evaluation/losslessness.py).

The speed-up is not read off those two runs: both servers stay up and are timed again in paired
rounds, the order alternating, and the median ratio counts only when the rounds agree
(evaluation/speedup.py; `paired_rounds` below).
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import requests

from eagle3_pipeline.errors import ServerError
from eagle3_pipeline.evaluation import draft_sweep, speedup
from eagle3_pipeline.evaluation import losslessness as lossless
from eagle3_pipeline.evaluation.acceptance import served_acceptance
from eagle3_pipeline.progress import log
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
    # per generated token, for the losslessness verdict; 0: none asked (the timing rounds)
    top_logprobs: int = 5
    near_tie_nats: float = 0.1  # evaluate.near_tie_nats (params.py)
    # evaluate.throughput_concurrency: the pair timed again in rounds at these concurrencies
    throughput_concurrency: tuple[int, ...] = ()
    speedup_rounds: int = 5  # evaluate.speedup_rounds: paired rounds per concurrency
    speedup_max_spread: float = 0.25  # evaluate.speedup_max_spread (evaluation/speedup.py)


@dataclass
class RunResult:
    """Outputs of one server run and the spec-decode counter deltas over its request phase."""

    token_ids: list[list[int]]
    texts: list[str]
    num_tokens: list[int]
    wall_s: float
    counters: dict[str, float]
    logprobs: list[list[lossless.TokenLogprobs] | None] = field(default_factory=list)

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
    """Warm the server with one short request, then time the prompts and diff the counters."""
    complete(client(url, settings), chat_payload(conversations[0], settings, max_tokens=4))
    k = settings.num_speculative_tokens
    before = settled_counters(url, k)
    results, wall = run_prompts(url, conversations, settings)
    after = settled_counters(url, k)
    counters = delta(before, after) | {"spec_decode_enabled": after["spec_decode_enabled"]}
    ids, texts, counts, logprobs = (list(x) for x in zip(*results, strict=True))
    return RunResult(ids, texts, counts, wall, counters, logprobs)


# --- servers up together, paired rounds ----------------------------------------------------


# Measures one server of the evaluation on prompts; every server it is asked about stays up
# between calls (`servers_up`; tests pass stand-ins).
Runner = Callable[[ServerSpec, Sequence[Messages], Settings], RunResult]


@contextlib.contextmanager
def servers_up(specs: Sequence[ServerSpec], together: bool) -> Iterator[Runner]:
    """Start the servers of `specs` and yield a runner measuring on them; all stop on exit.

    `together`: all at once (one start-up's wait, where memory holds them all: the CPU
    profiles); else one after the other, each kept up while the next starts. Either way all
    are up at once while the runner is used: the paired rounds need them so. Only one is busy
    at any time; the others take no requests meanwhile.
    """
    with contextlib.ExitStack() as stack:
        if together:
            urls = stack.enter_context(serve_many(list(specs)))
        else:
            urls = [stack.enter_context(serve(spec)) for spec in specs]
        by_log = {spec.log_file: url for spec, url in zip(specs, urls, strict=True)}

        def run(
            spec: ServerSpec, conversations: Sequence[Messages], settings: Settings
        ) -> RunResult:
            return measure(by_log[spec.log_file], conversations, settings)

        yield run


def serve_alone(
    spec: ServerSpec, conversations: Sequence[Messages], settings: Settings
) -> RunResult:
    """Start `spec`'s server, measure, stop it: one server up at a time (evaluate.speedup_rounds
    0, for a node whose memory holds one verifier: no paired rounds, no speed-up figure)."""
    with servers_up([spec], together=False) as run:
        return run(spec, conversations, settings)


@contextlib.contextmanager
def also_up(run: Runner, spec: ServerSpec, own_servers: bool) -> Iterator[Runner]:
    """`run`, and `spec`'s server beside the others for as long as the block lasts (a swept
    draft count's). With a runner given by the caller (`own_servers` False), that runner is
    asked about `spec` as about the others."""
    if not own_servers:
        yield run
        return
    with servers_up([spec], together=False) as run_spec:

        def either(
            s: ServerSpec, conversations: Sequence[Messages], settings: Settings
        ) -> RunResult:
            return (run_spec if s.log_file == spec.log_file else run)(s, conversations, settings)

        yield either


@dataclass
class Paired:
    """The drafter's server timed against the baseline's in paired rounds at one concurrency;
    `counters`: the drafter's spec-decode counter deltas summed over its rounds."""

    concurrency: int
    num_prompts: int
    rounds: list[speedup.Round] = field(default_factory=list)
    counters: dict[str, float] = field(default_factory=dict)

    def section(self, max_spread: float) -> dict[str, Any]:
        """tokens_per_s, tokens_per_s_baseline, speedup and the speedup_* keys of eval.json."""
        if not self.rounds:
            return speedup.not_paired(max_spread)
        return speedup.judge(self.rounds, max_spread, self.num_prompts)


def paired_rounds(
    run: Runner,
    baseline_spec: ServerSpec,
    drafter_spec: ServerSpec,
    conversations: Sequence[Messages],
    settings: Settings,
    concurrency: int,
) -> Paired:
    """`settings.speedup_rounds` rounds, each timing both servers (up together) on the same
    first prompts (`speedup.round_prompts`), the baseline first in rounds 0, 2, 4... and the
    drafter's server first in 1, 3, 5... (`speedup.first`).

    A round's requests are a user's: greedy, `max_new_tokens`, no logprobs (the full passes
    ask them for the verdict). Before each timed run the server answers one short request and
    its counters settle (`measure`), so both sides start a run alike: the full passes before the
    rounds already sent each server every prompt (prefix caches, allocators warm on both).
    """
    if settings.speedup_rounds < 1:
        return Paired(concurrency, 0)
    n = speedup.round_prompts(len(conversations), settings.speedup_rounds, concurrency)
    timed = replace(settings, concurrency=concurrency, top_logprobs=0, throughput_concurrency=())
    prompts = conversations[:n]
    paired = Paired(concurrency, n)
    for i in range(settings.speedup_rounds):
        order = [baseline_spec, drafter_spec]
        if speedup.first(i) == speedup.DRAFTER:
            order.reverse()
        got = {spec.log_file: run(spec, prompts, timed) for spec in order}
        base, drafted = got[baseline_spec.log_file], got[drafter_spec.log_file]
        paired.rounds.append(
            speedup.Round(drafted.output_tokens, drafted.wall_s, base.output_tokens, base.wall_s)
        )
        for key, value in drafted.counters.items():
            if key != "spec_decode_enabled":
                paired.counters[key] = paired.counters.get(key, 0.0) + value
        ratio = paired.rounds[-1].ratio
        log(
            "evaluate",
            f"speed-up round {i + 1}/{settings.speedup_rounds} at concurrency {concurrency} "
            f"({speedup.first(i)} first, {n} prompts): {drafted.tokens_per_s:.1f} vs "
            f"{base.tokens_per_s:.1f} tokens/s" + (f" (x{ratio:.2f})" if ratio is not None else ""),
        )
    return paired


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


def _acceptance(counters: dict[str, float], k: int) -> dict[str, Any]:
    served = served_acceptance(counters, k)
    return {key: served[key] for key in ("mean_acceptance_length", "acceptance_rate")}


def online_section(
    baseline: RunResult,
    spec: RunResult,
    k: int,
    timed: dict[int, Paired] | None = None,
    concurrency: int = 1,
    max_spread: float = 0.0,
) -> dict[str, Any]:
    """The `online` block of metrics/eval.json: acceptance and output tokens of the full passes,
    tokens/s and the speed-up of the paired rounds at `concurrency` (evaluation/speedup.py; with
    no `timed` rounds, the full passes alone: no speed-up figure);
    `by_concurrency` (keyed by the concurrency as a string) when the pair was timed at more than
    one, each row's acceptance counted over the drafter's rounds there (the full pass's at
    `concurrency`)."""
    timed = timed or {concurrency: Paired(concurrency, 0)}
    section = {
        "num_prompts": len(spec.texts),
        **served_acceptance(spec.counters, k),
        "output_tokens": spec.output_tokens,
        "output_tokens_baseline": baseline.output_tokens,
        **timed[concurrency].section(max_spread),
    }
    if len(timed) > 1:
        section["by_concurrency"] = {
            str(c): _acceptance(spec.counters if c == concurrency else paired.counters, k)
            | paired.section(max_spread)
            for c, paired in sorted(timed.items())
        }
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
    """Serve with and without the drafter; (online section, indices of differing outputs,
    losslessness verdict naming prompts by `prompt_ids`, default their indices).

    Both servers come up (at once with `start_together`, where memory holds two; else one after
    the other) and stay up to the end. Each first answers every prompt once, in turn, never
    side by side (two busy servers would share the cores): vLLM's acceptance counters and the
    outputs the verdict compares come from these full passes, as before. Then the paired rounds
    (`paired_rounds`) time the pair at `settings.concurrency` and again at each of
    `settings.throughput_concurrency`; eval.json's tokens/s and speed-up are theirs. With
    `settings.speedup_rounds` 0 the servers run one at a time (`serve_alone`), the full passes
    only, and there is no speed-up figure.

    `runner` measures on servers the caller keeps up for the whole call (tests, and servers
    started for several evaluations); None: `servers_up` starts them. `sweep`: further draft
    counts, each served beside the two (one server start each, three up meanwhile), given a
    full pass and paired rounds against the baseline at `settings.concurrency`
    (evaluation.draft_sweep).
    """
    if not conversations:
        raise ValueError("online evaluation needs at least one prompt")
    k = settings.num_speculative_tokens
    baseline_spec, eagle_spec = server_specs(base, drafter, k, log_dir, family)
    paired_up = settings.speedup_rounds > 0
    with contextlib.ExitStack() as stack:
        if runner is not None:
            run = runner
        elif paired_up:
            run = stack.enter_context(servers_up([baseline_spec, eagle_spec], start_together))
        else:
            run = serve_alone
        baseline = run(baseline_spec, conversations, settings)
        spec = run(eagle_spec, conversations, settings)
        if not spec.counters.get("spec_decode_enabled"):
            raise ServerError(
                f"vLLM was started with the drafter but its /metrics has no {SPEC_PREFIX}* "
                f"counters: speculative decoding is off; see {eagle_spec.log_file}"
            )
        timed: dict[int, Paired] = {}
        for c in (settings.concurrency, *(settings.throughput_concurrency if paired_up else ())):
            if c not in timed:
                timed[c] = paired_rounds(run, baseline_spec, eagle_spec, conversations, settings, c)
        runs = {k: (spec, timed[settings.concurrency])}
        for n in (n for n in sweep if n not in runs):
            _, at_n = server_specs(base, drafter, n, log_dir, family)
            at_n = replace(at_n, log_file=log_dir / f"vllm-{family}-k{n}.log")
            at_settings = replace(settings, num_speculative_tokens=n, throughput_concurrency=())
            with also_up(run, at_n, own_servers=runner is None and paired_up) as run_n:
                drafted = run_n(at_n, conversations, at_settings)
                paired = paired_rounds(
                    run_n, baseline_spec, at_n, conversations, at_settings, settings.concurrency
                )
            runs[n] = (drafted, paired)
    names = list(prompt_ids) if prompt_ids is not None else [str(i) for i in range(len(spec.texts))]
    spread = settings.speedup_max_spread
    section = online_section(baseline, spec, k, timed, settings.concurrency, spread)
    swept = {n: (drafted, paired.section(spread)) for n, (drafted, paired) in runs.items()}
    return (
        section | draft_sweep.section(baseline, swept),
        mismatched_prompts(baseline, spec),
        verdict(names, baseline, spec, settings),
    )
