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
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from eagle3_pipeline.core.errors import ServerError
from eagle3_pipeline.evaluation import draft_sweep, served
from eagle3_pipeline.evaluation import losslessness as lossless
from eagle3_pipeline.evaluation.acceptance import served_acceptance
from eagle3_pipeline.evaluation.held_out import HeldOutSet, serve_set, served_detail
from eagle3_pipeline.evaluation.measure import SPEC_PREFIX, Messages, RunResult, Settings, measure
from eagle3_pipeline.evaluation.paired import (
    Paired,
    Runner,
    mismatched_prompts,
    paired_rounds,
    verdict,
)
from eagle3_pipeline.serving.server import ServerSpec, serve, serve_many

# --- servers up together, paired rounds ----------------------------------------------------


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
