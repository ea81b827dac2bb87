"""Served acceptance, read from vLLM's own counts for each answer.

Started with `SPEC_METRICS_ARGS`, vLLM returns with every answer the number of draft tokens
accepted at each of its verify steps, in order (`metrics.speculative_decoding.per_step_accepted`):
the same counts its `vllm:spec_decode_*` Prometheus counters sum over all requests, so the totals
here are checked against those counters (evaluation/online.py). Per answer they give what the
counters cannot:
- acceptance by answer position: a verify step that starts at answer token t counts in window
  t // answer_window (token 0 comes from the prefill, without a draft); acceptance falls with the
  position, so a figure over short answers flatters a drafter;
- answers apart by kind: one that loops (its tail repeats with a short period, which a drafter
  predicts easily: one loop measured 7.76 against 2.68 healthy), one cut at max_tokens, and one
  that ended on its own. The headline counts every answer (what a user gets); `healthy` leaves
  the looping ones out.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from eagle3_pipeline.evaluation.acceptance import summary

# vLLM's per-request spec-decode counts, ordered per verify step (vLLM >= 0.32).
SPEC_METRICS_ARGS = ("--per-request-spec-decode-metrics", "detailed")

# A tail that repeats with a period of at most LOOP_MAX_PERIOD tokens over at least
# max(LOOP_MIN_SPAN, LOOP_REPEATS * period) tokens is a loop.
LOOP_MAX_PERIOD = 64
LOOP_MIN_SPAN = 48
LOOP_REPEATS = 3


@dataclass(frozen=True)
class Answer:
    """One served answer: its tokens, vLLM's accepted and drafted counts per verify step, and
    whether it was cut at max_tokens."""

    token_ids: Sequence[int]
    accepted: Sequence[int]
    drafted: Sequence[int]
    cut: bool
    category: str = ""

    @property
    def kind(self) -> str:
        """ "looping", "cut" (at max_tokens, no loop) or "finished" (ended on its own)."""
        if loops(self.token_ids):
            return "looping"
        return "cut" if self.cut else "finished"


def loops(token_ids: Sequence[int]) -> bool:
    """True when the answer's tail repeats with a short period (see LOOP_*)."""
    ids = list(token_ids)
    for period in range(1, LOOP_MAX_PERIOD + 1):
        span = max(LOOP_MIN_SPAN, LOOP_REPEATS * period)
        if len(ids) < span + period:
            break
        tail = len(ids) - span
        if all(ids[i] == ids[i - period] for i in range(tail, len(ids))):
            return True
    return False


def acceptance(answers: Iterable[Answer], k: int) -> dict[str, Any]:
    """acceptance.summary over the verify steps of `answers` (k drafts per step)."""
    steps = [
        (a, d) for answer in answers for a, d in zip(answer.accepted, answer.drafted, strict=True)
    ]
    per_pos = [sum(1 for a, _ in steps if a > p) for p in range(k)]
    return summary(len(steps), sum(d for _, d in steps), sum(a for a, _ in steps), per_pos)


def by_answer_position(answers: Sequence[Answer], k: int, window: int) -> list[dict[str, Any]]:
    """Acceptance per window of `window` answer tokens, in order: {"tokens": [first, last],
    "num_answers": answers reaching it, **acceptance.summary}."""
    windows: dict[int, list[tuple[int, int]]] = {}
    reached: dict[int, int] = {}
    for answer in answers:
        at = 1  # the prefill's token
        seen: set[int] = set()
        for a, d in zip(answer.accepted, answer.drafted, strict=True):
            w = at // window
            windows.setdefault(w, []).append((a, d))
            seen.add(w)
            at += a + 1
        for w in seen:
            reached[w] = reached.get(w, 0) + 1
    rows = []
    for w in sorted(windows):
        steps = windows[w]
        per_pos = [sum(1 for a, _ in steps if a > p) for p in range(k)]
        rows.append(
            {
                "tokens": [w * window, (w + 1) * window - 1],
                "num_answers": reached[w],
                **summary(len(steps), sum(d for _, d in steps), sum(a for a, _ in steps), per_pos),
            }
        )
    return rows


def _brief(answers: Sequence[Answer], k: int) -> dict[str, Any]:
    """Count and acceptance of one group of answers; a group with no answers has no acceptance
    (null, not the 1.0 that zero drafts would read as)."""
    if not answers:
        return {
            "count": 0,
            "mean_acceptance_length": None,
            "acceptance_per_position": None,
            "num_drafts": 0,
        }
    got = acceptance(answers, k)
    return {
        "count": len(answers),
        "mean_acceptance_length": got["mean_acceptance_length"],
        "acceptance_per_position": got["acceptance_per_position"],
        "num_drafts": got["num_drafts"],
    }


def section(answers: Sequence[Answer], k: int, window: int) -> dict[str, Any]:
    """One prompt set's served figures: acceptance over every answer, per draft position
    (`acceptance_per_position`), by answer position, per kind of answer (`looping`, `cut`,
    `finished`, and `healthy`: all but the looping ones) and per category where the set has
    more than one."""
    kinds: dict[str, list[Answer]] = {"looping": [], "cut": [], "finished": []}
    for answer in answers:
        kinds[answer.kind].append(answer)
    out: dict[str, Any] = {
        "num_answers": len(answers),
        **acceptance(answers, k),
        "answer_window": window,
        "by_answer_position": by_answer_position(answers, k, window),
        **{kind: _brief(group, k) for kind, group in kinds.items()},
        "healthy": _brief(kinds["cut"] + kinds["finished"], k),
    }
    categories = sorted({a.category for a in answers})
    if len(categories) > 1:
        out["by_category"] = {
            c: _brief([a for a in answers if a.category == c], k) for c in categories
        }
    return out


def step_counts(metrics: Any) -> tuple[list[int], list[int]] | None:
    """(accepted, drafted) per verify step from a response's `metrics` field; None where vLLM
    sent none (speculation off, or the server started without SPEC_METRICS_ARGS)."""
    if not isinstance(metrics, dict):
        return None
    spec = metrics.get("speculative_decoding")
    if not isinstance(spec, dict) or spec.get("per_step_accepted") is None:
        return None
    accepted = [int(a) for a in spec["per_step_accepted"]]
    drafted = spec.get("per_step_drafted") or [spec["num_spec_tokens"]] * len(accepted)
    return accepted, [int(d) for d in drafted]
