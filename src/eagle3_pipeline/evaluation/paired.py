"""The two servers of an online evaluation compared: timed in paired rounds (the order
alternating, evaluation/speedup.py), and their greedy outputs judged token by token
(evaluation/losslessness.py). How the servers are started is online.py's business: a `Runner`
measures one of them on prompts."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from eagle3_pipeline.core.errors import ServerError
from eagle3_pipeline.core.progress import log
from eagle3_pipeline.evaluation import losslessness as lossless
from eagle3_pipeline.evaluation import speedup
from eagle3_pipeline.evaluation.measure import Messages, RunResult, Settings
from eagle3_pipeline.serving.server import ServerSpec

# Measures one server of the evaluation on prompts; every server it is asked about stays up
# between calls (`servers_up`; tests pass stand-ins).
Runner = Callable[[ServerSpec, Sequence[Messages], Settings], RunResult]


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
