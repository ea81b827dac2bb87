"""Public prompt sets held out of training (load_sets), each served like the val prompts on the
same two servers (online.py): full passes per turn for the served figures and the verdict, then
paired rounds; multi-turn sets ask each next turn after the baseline's answer."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3_pipeline.config.params import EvaluateParams
from eagle3_pipeline.core import readers
from eagle3_pipeline.core.errors import DataError
from eagle3_pipeline.core.progress import log
from eagle3_pipeline.evaluation import losslessness as lossless
from eagle3_pipeline.evaluation import prompt_sets, served
from eagle3_pipeline.evaluation.measure import Messages, RunResult, Settings
from eagle3_pipeline.evaluation.paired import Runner, paired_rounds, verdict
from eagle3_pipeline.serving.server import ServerSpec

STAGE = "evaluate"


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
        STAGE,
        f"served on {held.name} ({len(held.ids)} prompts, {len(answers)} answers): mean "
        f"acceptance length {section['mean_acceptance_length']:.3f}, "
        f"{section['looping']['count']} looping, {section['cut']['count']} cut at "
        f"{settings.max_new_tokens} tokens, lossless: {judged.outcome}",
    )
    return section, judged


def load_sets(
    e: EvaluateParams, train_prompts: Path, near_duplicate_jaccard: float
) -> list[HeldOutSet]:
    """evaluate.public_sets as served: the first evaluate.public_set_prompts prompts of each,
    in prompt_sets.chosen's order, that the training prompts hold no copy or near duplicate of
    (prepare.synthesize's near_duplicate_jaccard), read from `train_prompts`."""
    if not e.public_sets:
        return []
    if not train_prompts.is_file():
        raise DataError(f"{train_prompts}: not found: run the prepare stage")
    training = [
        prompt_sets.user_text(r.get("messages", [])) for r in readers.read_jsonl(train_prompts)
    ]
    threshold = near_duplicate_jaccard
    out = []
    for name in e.public_sets:
        got = prompt_sets.load(name)
        kept, left_out = prompt_sets.held_out(prompt_sets.chosen(got.prompts), training, threshold)
        kept = kept[: e.public_set_prompts]
        if not kept:
            raise DataError(
                f"public prompt set {name!r}: every prompt is in the training data "
                f"({train_prompts}): drop it from evaluate.public_sets"
            )
        if left_out:
            log(STAGE, f"{name}: {len(left_out)} prompts left out as duplicates: {left_out[:5]}")
        out.append(
            HeldOutSet(
                name,
                got.source,
                [p.id for p in kept],
                [p.messages for p in kept],
                [p.category for p in kept],
                left_out,
                [p.later_turns for p in kept],
            )
        )
    return out
