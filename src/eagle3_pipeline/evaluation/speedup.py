"""A drafter's speed-up that can be believed: paired, interleaved rounds and their spread.

Tokens/s of a server measured once with the drafter and once without, at two moments, compare
two machines: on a shared machine the load in between decides the ratio (x10.83 was recorded
so, 110.5 vs 10.2 tokens/s). So evaluation/online.py keeps both servers up and times them in
rounds on the same prompts, the order swapped every round (baseline first, then the drafter
first, ...: A B, B A, A B, ...), and this module turns the rounds into the figure:

- each round gives one ratio, tokens/s with the drafter over without, of two runs a few
  seconds apart: a drift of the machine's speed hits both sides of it alike;
- the speed-up is the MEDIAN of the rounds' ratios, the lower median for an even count (a
  ratio one round measured, never an average of two), so one disturbed round cannot move it;
  `tokens_per_s` and `tokens_per_s_baseline` are that round's own figures, so the three keys
  eval.json has always had still read as "X vs Y tokens/s (xX/Y)";
- the spread, (max - min) / median of the ratios, says how far the rounds disagree; above
  `evaluate.speedup_max_spread` (default 0.25) the machine's speed changed within the rounds,
  and no figure is given: `speedup` is null, with the ratios, the spread and the reason beside
  it. One round shows no spread, so it gives no figure either, nor do no rounds at all.

Pure arithmetic on measured rounds (no server, no params): the report and the end-of-run summary
read the same keys back through `describe` and `cell`.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

BASELINE, DRAFTER = "baseline", "drafter"


def first(round_index: int) -> str:
    """Which server a round times first: the baseline in rounds 0, 2, 4..., the drafter's in
    1, 3, 5... (A B B A A B ...): a drift that slows the second run of a round slows each side
    in every other round, and a steady drift over two rounds hits both sides equally."""
    return BASELINE if round_index % 2 == 0 else DRAFTER


def round_prompts(num_prompts: int, rounds: int, concurrency: int) -> int:
    """How many prompts one round sends each server: the first `num_prompts / rounds` of the
    eval prompts (rounded up), so all rounds together cost about one pass over the prompts per
    server, but at least two waves of `concurrency` requests (fewer would not keep that many in
    flight), and never more than there are."""
    return min(num_prompts, max(math.ceil(num_prompts / rounds), 2 * concurrency))


@dataclass(frozen=True)
class Round:
    """One paired round: output tokens and wall seconds of each server on the same prompts."""

    tokens: int
    wall_s: float
    tokens_baseline: int
    wall_s_baseline: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def tokens_per_s_baseline(self) -> float:
        return self.tokens_baseline / self.wall_s_baseline if self.wall_s_baseline > 0 else 0.0

    @property
    def ratio(self) -> float | None:
        """Tokens/s with the drafter over without; None when either side produced nothing."""
        if self.tokens_per_s <= 0 or self.tokens_per_s_baseline <= 0:
            return None
        return self.tokens_per_s / self.tokens_per_s_baseline


def spread(ratios: Sequence[float]) -> float:
    """(max - min) / median (the lower median, as the figure)."""
    return (max(ratios) - min(ratios)) / statistics.median_low(ratios)


def judge(rounds: Sequence[Round], max_spread: float, num_prompts: int) -> dict[str, Any]:
    """eval.json keys of a drafter's paired rounds (`num_prompts`: the prompts each round sent).

    `speedup` is the median ratio when there are two or more rounds whose spread is at most
    `max_spread`, else None, and `speedup_note` says which; `speedup_rounds` lists the ratios
    in round order (the baseline first in rounds 0, 2, 4...), `speedup_rounds_tokens_per_s`
    each round's [with, without] tokens/s.
    """
    if not rounds:
        raise ValueError("a speed-up needs at least one round")
    ratios = [r.ratio for r in rounds]
    measured = [x for x in ratios if x is not None]
    out: dict[str, Any] = {
        "tokens_per_s": None,
        "tokens_per_s_baseline": None,
        "speedup": None,
        "speedup_rounds": ratios,
        "speedup_rounds_tokens_per_s": [[r.tokens_per_s, r.tokens_per_s_baseline] for r in rounds],
        "speedup_num_prompts": num_prompts,
        "speedup_spread": None,
        "speedup_max_spread": max_spread,
        "speedup_trusted": False,
    }
    if len(measured) < len(ratios):
        empty = next(i for i, x in enumerate(ratios) if x is None)
        return out | {
            "speedup_note": f"no figure: round {empty} produced no output tokens on one server"
        }
    median = statistics.median_low(measured)
    middle = rounds[ratios.index(median)]
    out |= {
        "tokens_per_s": middle.tokens_per_s,
        "tokens_per_s_baseline": middle.tokens_per_s_baseline,
    }
    if len(rounds) < 2:
        return out | {
            "speedup_note": "no figure: one round shows no spread to judge it by "
            "(evaluate.speedup_rounds: 1; two or more give a figure)"
        }
    wide = spread(measured)
    out["speedup_spread"] = wide
    if wide > max_spread:
        return out | {
            "speedup_note": f"no figure: the {len(rounds)} paired rounds' ratios range from "
            f"x{min(measured):.2f} to x{max(measured):.2f}, a spread of {wide:.2f} above "
            f"evaluate.speedup_max_spread={max_spread:g}: the machine's speed changed during "
            "the rounds (other work on it?), rerun evaluate on a quiet machine"
        }
    return out | {
        "speedup": median,
        "speedup_trusted": True,
        "speedup_note": f"median of {len(rounds)} paired rounds (order alternating, the first "
        f"{num_prompts} prompts each), spread {wide:.2f} <= {max_spread:g}",
    }


def not_paired(max_spread: float) -> dict[str, Any]:
    """eval.json keys when no rounds ran (evaluate.speedup_rounds 0: the servers one at a time,
    on a node whose memory holds one verifier): no tokens/s, no figure, and why."""
    return {
        "tokens_per_s": None,
        "tokens_per_s_baseline": None,
        "speedup": None,
        "speedup_rounds": [],
        "speedup_rounds_tokens_per_s": [],
        "speedup_num_prompts": 0,
        "speedup_spread": None,
        "speedup_max_spread": max_spread,
        "speedup_trusted": False,
        "speedup_note": "no figure: not measured (evaluate.speedup_rounds: 0, the servers ran one "
        "at a time; one pass each, minutes apart, makes no speed-up)",
    }


def describe(row: Mapping[str, Any]) -> str:
    """One phrase for a log or summary line: "x1.36, median of 5 paired rounds, spread 0.08",
    or why there is no figure. An eval.json from before the rounds: "x1.36, one run each, not
    paired"."""
    if "speedup_trusted" not in row:
        value = row.get("speedup")
        if isinstance(value, (int, float)):
            return f"x{value:.2f}, one run each, not paired"
        return "no speed-up figure"
    if row.get("speedup_trusted"):
        n, wide = len(row.get("speedup_rounds") or []), row["speedup_spread"]
        return f"x{row['speedup']:.2f}, median of {n} paired rounds, spread {wide:.2f}"
    return f"no speed-up figure: {str(row.get('speedup_note', '')).removeprefix('no figure: ')}"


def throughput(row: Mapping[str, Any]) -> str:
    """Tokens/s with and without the drafter (the median round's) and the speed-up, or, when
    the rounds spread too wide, the reason there is no figure: the summary's and the log's."""
    with_, without = row.get("tokens_per_s"), row.get("tokens_per_s_baseline")
    if with_ is None or without is None:
        return describe(row)
    measured = f"{with_:.1f} tokens/s with the drafter vs {without:.1f} without"
    if row.get("speedup") is None:
        return f"{measured} in the median round, {describe(row)}"
    return f"{measured} ({describe(row)})"


def cell(row: Mapping[str, Any]) -> str:
    """The speed-up as a table cell: "x1.36", or "none (spread 0.48)" when the rounds were too
    far apart, "none (1 round)" or "none (0 rounds)", "-" when nothing was served."""
    value = row.get("speedup")
    if isinstance(value, (int, float)):
        return f"x{value:.2f}"
    wide = row.get("speedup_spread")
    if isinstance(wide, (int, float)):
        return f"none (spread {wide:.2f})"
    rounds = row.get("speedup_rounds")
    if isinstance(rounds, list) and len(rounds) < 2:
        return f"none ({len(rounds)} round{'' if len(rounds) == 1 else 's'})"
    return "none" if "speedup_trusted" in row else "-"
