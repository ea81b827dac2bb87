"""Online evaluation: the verifier served by vLLM with and without the drafter, on val prompts.

The offline simulation can agree with itself and still disagree with vLLM (layer ids, vocab
mapping, norm flags, another verifier): only vLLM's own counters show that drafts are accepted.
The run without speculation is the throughput baseline and, at temperature 0, the reference
output that speculative decoding must reproduce: both runs request top-k logprobs, so that a
divergence can be judged as vLLM judges its own (evaluation/losslessness.py).

The speed-up is not read off those two runs: both servers stay up and are timed again in paired
rounds, the order alternating, and the median ratio counts only when the rounds agree
(evaluation/speedup.py; `paired_rounds` below). Each server is measured as evaluation/measure.py
measures one; this module starts the servers, pairs their rounds and compares the two.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from eagle3_pipeline.core.errors import ServerError
from eagle3_pipeline.core.progress import log
from eagle3_pipeline.evaluation import draft_sweep, served, speedup
from eagle3_pipeline.evaluation import losslessness as lossless
from eagle3_pipeline.evaluation.acceptance import served_acceptance
from eagle3_pipeline.evaluation.measure import SPEC_PREFIX, Messages, RunResult, Settings, measure
from eagle3_pipeline.serving.server import ServerSpec, serve, serve_many

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
    """vLLM's speculative config for a drafter of `family` (config/families.py).

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
    """(baseline, speculative) variants of one server spec; only the drafter differs, and the
    drafter's server returns vLLM's spec-decode counts with each answer (served.py)."""
    baseline = replace(base, speculative_config=None, log_file=log_dir / "vllm-baseline.log")
    spec = replace(
        base,
        speculative_config=speculative_config(drafter, k, family),
        log_file=log_dir / f"vllm-{family}.log",
        extra_args=[*base.extra_args, *served.SPEC_METRICS_ARGS],
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


@dataclass(frozen=True)
class HeldOutSet:
    """A public prompt set served like the val prompts (evaluation/prompt_sets.py);
    `later_turns[i]`: prompt i's next user turns (multi-turn sets), each asked after the
    answer before it."""

    name: str
    source: str
    ids: list[str]
    conversations: list[Messages]
    categories: list[str]
    # ids left out: a copy or near duplicate of a training prompt, or of one kept before
    left_out: list[str] = field(default_factory=list)
    later_turns: list[list[str]] = field(default_factory=list)


def served_detail(
    run: RunResult, k: int, window: int, categories: Sequence[str] | None
) -> dict[str, Any]:
    """served.section of the drafter's full pass, and whether vLLM's per-answer counts add up
    to its Prometheus counters over the same pass (`counts_match_counters`)."""
    answers = run.answers(categories)
    return served.section(answers, k, window) | {
        "counts_match_counters": _counts_match(answers, run.counters)
    }


def _counts_match(answers: Sequence[served.Answer], counters: dict[str, float]) -> bool:
    """The answers' verify steps and accepted tokens equal the counters' deltas."""
    steps = sum(len(a.accepted) for a in answers)
    accepted = sum(sum(a.accepted) for a in answers)
    return steps == int(counters.get("num_drafts", -1)) and accepted == int(
        counters.get("num_accepted_tokens", -1)
    )


def _next_turn(
    conversations: list[Messages], answers: list[str], later: list[list[str]]
) -> tuple[list[int], list[Messages]]:
    """(indices, conversations) of the prompts with a next user turn (`later[i][0]`), each
    asked after the answer given to the turn before."""
    picked = [i for i, turns in enumerate(later) if turns]
    return picked, [
        [
            *conversations[i],
            {"role": "assistant", "content": answers[i]},
            {"role": "user", "content": later[i][0]},
        ]
        for i in picked
    ]


def serve_set(
    run: Runner,
    specs: tuple[ServerSpec, ServerSpec],
    held: HeldOutSet,
    settings: Settings,
    concurrencies: Sequence[int],
    window: int,
) -> tuple[dict[str, Any], lossless.Verdict]:
    """A public set on both servers: a full pass each per turn (served figures, losslessness),
    then paired rounds at each of `concurrencies` on its last turn's conversations; (its
    section of eval.json's `served`, verdict).

    A multi-turn set's next turn follows the baseline's answer on both servers (the same
    request to each, so their outputs still compare); its answers count with the first
    turn's, and `by_turn` sets them apart."""
    baseline_spec, eagle_spec = specs
    k = settings.num_speculative_tokens
    conversations, ids, categories = list(held.conversations), list(held.ids), held.categories
    later = held.later_turns or [[] for _ in ids]
    answers: list[served.Answer] = []
    by_turn: list[dict[str, Any]] = []
    judged: lossless.Verdict | None = None
    counted = True
    turn = 0
    while conversations:
        baseline = run(baseline_spec, conversations, settings)
        spec = run(eagle_spec, conversations, settings)
        names = [i if turn == 0 else f"{i}#turn{turn + 1}" for i in ids]
        got = verdict(names, baseline, spec, settings)
        judged = got if judged is None else lossless.combine(judged, got)
        turn_answers = spec.answers(categories)
        answers += turn_answers
        counted = counted and _counts_match(turn_answers, spec.counters)
        by_turn.append({"turn": turn + 1, **served.acceptance(turn_answers, k)})
        last = conversations
        turn += 1
        picked, conversations = _next_turn(conversations, baseline.texts, later)
        ids = [ids[i] for i in picked]
        categories = [categories[i] for i in picked]
        later = [later[i][1:] for i in picked]
    if judged is None:
        raise ValueError(f"public set {held.name}: no prompt to serve")
    timed = {
        c: paired_rounds(run, baseline_spec, eagle_spec, last, settings, c)
        for c in dict.fromkeys(concurrencies)
    }
    section = {
        "source": held.source,
        "num_prompts": len(held.ids),
        "left_out_as_duplicates": held.left_out,
        "max_new_tokens": settings.max_new_tokens,
        **served.section(answers, k, window),
        "counts_match_counters": counted,
        **({"by_turn": by_turn} if len(by_turn) > 1 else {}),
        "lossless": judged.outcome,
        "num_identical": judged.section()["num_identical"],
        "speedup_by_concurrency": {
            str(c): paired.section(settings.speedup_max_spread) for c, paired in timed.items()
        },
    }
    log(
        "evaluate",
        f"served on {held.name} ({len(held.ids)} prompts, {len(answers)} answers): mean "
        f"acceptance length {section['mean_acceptance_length']:.3f}, "
        f"{section['looping']['count']} looping, {section['cut']['count']} cut at "
        f"{settings.max_new_tokens} tokens, lossless: {judged.outcome}",
    )
    return section, judged


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
    held_out: Sequence[HeldOutSet] = (),
    answer_window: int = 64,
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
    (evaluation.draft_sweep). `held_out`: public prompt sets, each served as `serve_set` serves
    it on the same two servers (section `held_out`, keyed by name; their verdicts fold into the
    one returned); `answer_window`: served.by_answer_position's window.
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
        concurrencies = [
            settings.concurrency,
            *(settings.throughput_concurrency if paired_up else ()),
        ]
        public = {
            held.name: serve_set(
                run, (baseline_spec, eagle_spec), held, settings, concurrencies, answer_window
            )
            for held in held_out
        }
    names = list(prompt_ids) if prompt_ids is not None else [str(i) for i in range(len(spec.texts))]
    spread = settings.speedup_max_spread
    section = online_section(baseline, spec, k, timed, settings.concurrency, spread)
    if spec.steps and all(s is not None for s in spec.steps):
        section["served"] = served_detail(spec, k, answer_window, None)
    if public:
        section["held_out"] = {name: got for name, (got, _) in public.items()}
    swept = {n: (drafted, paired.section(spread)) for n, (drafted, paired) in runs.items()}
    judged = verdict(names, baseline, spec, settings)
    for _, set_verdict in public.values():
        judged = lossless.combine(judged, set_verdict)
    return (
        section | draft_sweep.section(baseline, swept),
        mismatched_prompts(baseline, spec),
        judged,
    )
