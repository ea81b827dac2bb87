"""The speed-up measured in paired, interleaved rounds (evaluation/speedup.py, and the rounds in
evaluation/online.py) without vLLM: the statistics on given rounds, then two scripted OpenAI-like
servers (tests/helpers/fake_openai.py) standing in for the servers with and without the drafter.

The scripted servers do not sleep: each request advances a clock that online.py reads instead
of the machine's, so a ratio is exactly what the script says. On this shared 2-core machine real
sleeps of 40 and 80 ms gave ratios from x0.75 to x3.9 for a script that says x2: the very noise
the rounds are there to expose."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from fake_openai import fake_servers, reply

from eagle3_pipeline.evaluation import measure, speedup
from eagle3_pipeline.evaluation import online as oe
from eagle3_pipeline.evaluation.speedup import Round
from eagle3_pipeline.serving.server import ServerSpec


def _rounds(*ratios: float) -> list[Round]:
    """Rounds of 100 tokens without the drafter in 1 s (100 tokens/s), `ratio` x that with it."""
    return [Round(100, 1.0 / r, 100, 1.0) for r in ratios]


# --- the statistics --------------------------------------------------------------------------


def test_the_order_alternates_abba() -> None:
    assert [speedup.first(i) for i in range(5)] == [
        "baseline",
        "drafter",
        "baseline",
        "drafter",
        "baseline",
    ]


def test_a_round_sends_a_share_of_the_prompts_but_two_waves_at_least() -> None:
    assert speedup.round_prompts(24, 5, 1) == 5  # ~ one pass per server over all rounds
    assert speedup.round_prompts(64, 5, 16) == 32  # two waves of 16
    assert speedup.round_prompts(6, 5, 8) == 6  # never more than there are
    assert speedup.round_prompts(3, 1, 1) == 3


def test_a_tight_spread_gives_the_median_and_that_round_s_tokens_per_s() -> None:
    out = speedup.judge(_rounds(1.30, 1.36, 1.41, 1.33, 1.38), 0.25, 5)
    assert out["speedup"] == pytest.approx(1.36) and out["speedup_trusted"] is True
    assert out["speedup_spread"] == pytest.approx((1.41 - 1.30) / 1.36)
    assert out["speedup_rounds"] == pytest.approx([1.30, 1.36, 1.41, 1.33, 1.38])
    # the median round's own figures: with / without reads as the speed-up
    assert out["tokens_per_s"] == pytest.approx(136.0) and out["tokens_per_s_baseline"] == 100
    assert out["speedup_rounds_tokens_per_s"][2] == pytest.approx([141.0, 100.0])
    assert out["speedup_num_prompts"] == 5 and out["speedup_max_spread"] == 0.25
    assert "median of 5 paired rounds" in out["speedup_note"]


def test_an_even_count_takes_the_lower_median_a_measured_ratio() -> None:
    out = speedup.judge(_rounds(1.2, 1.3, 1.25, 1.35), 0.25, 4)
    assert out["speedup"] == pytest.approx(1.25)  # not 1.275, which no round measured


def test_a_wide_spread_gives_no_figure_but_the_ratios_spread_and_reason() -> None:
    """The x10.83 case: one round on a machine that slowed down for the baseline's run."""
    out = speedup.judge(_rounds(1.3, 10.83, 1.35, 1.28, 1.4), 0.25, 5)
    assert out["speedup"] is None and out["speedup_trusted"] is False
    assert out["speedup_rounds"] == pytest.approx([1.3, 10.83, 1.35, 1.28, 1.4])
    assert out["speedup_spread"] == pytest.approx((10.83 - 1.28) / 1.35)
    assert out["speedup_note"].startswith("no figure: the 5 paired rounds' ratios range from ")
    assert "x1.28 to x10.83" in out["speedup_note"]
    assert "evaluate.speedup_max_spread=0.25" in out["speedup_note"]


def test_one_round_or_an_empty_one_gives_no_figure() -> None:
    one = speedup.judge(_rounds(1.3), 0.25, 5)
    assert one["speedup"] is None and one["speedup_spread"] is None
    assert "one round shows no spread" in one["speedup_note"]
    assert one["tokens_per_s"] == pytest.approx(130.0)
    empty = speedup.judge([*_rounds(1.3, 1.3), Round(100, 1.0, 0, 1.0)], 0.25, 5)
    assert empty["speedup"] is None and empty["speedup_rounds"][2] is None
    assert "round 2 produced no output tokens" in empty["speedup_note"]
    with pytest.raises(ValueError, match="at least one round"):
        speedup.judge([], 0.25, 5)


def test_describe_and_cell() -> None:
    tight = speedup.judge(_rounds(1.3, 1.36, 1.41), 0.25, 5)
    wide = speedup.judge(_rounds(1.0, 2.0, 1.5), 0.25, 5)
    assert speedup.describe(tight) == "x1.36, median of 3 paired rounds, spread 0.08"
    assert speedup.describe(wide).startswith("no speed-up figure: the 3 paired rounds' ratios")
    assert speedup.describe({"speedup": 1.5}) == "x1.50, one run each, not paired"  # older
    assert speedup.cell(tight) == "x1.36" and speedup.cell(wide) == "none (spread 0.67)"
    assert speedup.cell(speedup.judge(_rounds(1.3), 0.25, 5)) == "none (1 round)"
    assert speedup.cell({"speedup": 1.5}) == "x1.50" and speedup.cell({}) == "-"
    none = speedup.not_paired(0.25)
    assert speedup.cell(none) == "none (0 rounds)" and none["speedup"] is None
    assert speedup.describe(none).startswith("no speed-up figure: not measured")


# --- rounds against two scripted servers ------------------------------------------------------

PROMPTS = [[{"role": "user", "content": f"question q{i}"}] for i in range(6)]
BASE_S, DRAFTER_S = 0.08, 0.04  # seconds per request: the drafter's server twice as fast


class Pair:
    """Two scripted servers, the baseline's and the drafter's: every request they answer in
    arrival order, each advancing the clock by its server's seconds, the drafter's
    `slow_rounds`-fold in the given rounds."""

    def __init__(self, start: Any, slow_rounds: dict[int, float] | None = None) -> None:
        self.events: list[tuple[str, str]] = []  # (server, full | warm | round)
        self.slow_rounds = slow_rounds or {}
        self.clock = 0.0
        self._timed = 0  # the drafter's round requests so far
        self._lock = threading.Lock()
        self.baseline = start(lambda body: self._answer("baseline", body, BASE_S))
        self.drafter = start(lambda body: self._answer("drafter", body, DRAFTER_S))
        self.per_round = 0  # prompts per round, set by the test

    def now(self) -> float:
        with self._lock:
            return self.clock

    def _answer(self, server: str, body: dict[str, Any], seconds: float) -> tuple[int, dict]:
        kind = "warm" if body["max_tokens"] == 4 else "full" if body.get("logprobs") else "round"
        with self._lock:
            self.events.append((server, kind))
            if server == "drafter" and kind == "round":
                seconds *= self.slow_rounds.get(self._timed // self.per_round, 1.0)
                self._timed += 1
            self.clock += seconds if kind != "warm" else 0.0
        return reply(None, "answer", token_ids=[1] * 8, completion_tokens=8)


@pytest.fixture
def start() -> Iterator[Any]:
    with fake_servers() as start:
        yield start


def _evaluate(
    pair: Pair, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, **settings: Any
) -> dict[str, Any]:
    """oe.evaluate with both scripted servers up together (as start_servers_together)."""

    @contextlib.contextmanager
    def serve_many(specs: list[ServerSpec]):
        assert [bool(s.speculative_config) for s in specs] == [False, True]
        yield [pair.baseline.url, pair.drafter.url]

    def counters(url: str, k: int) -> dict[str, float]:
        zero = {"num_drafts": 0.0, "num_draft_tokens": 0.0, "num_accepted_tokens": 0.0}
        enabled = float(url == pair.drafter.url)
        return (
            zero | {f"accepted_pos_{p}": 0.0 for p in range(k)} | {"spec_decode_enabled": enabled}
        )

    monkeypatch.setattr(oe, "serve_many", serve_many)
    monkeypatch.setattr(measure, "settled_counters", counters)
    monkeypatch.setattr(measure, "time", SimpleNamespace(monotonic=pair.now))
    run = oe.Settings(num_speculative_tokens=3, max_new_tokens=8, **settings)
    pair.per_round = speedup.round_prompts(len(PROMPTS), run.speedup_rounds, run.concurrency)
    base = ServerSpec(model="v", log_file=tmp_path / "x.log")
    section, differing, verdict = oe.evaluate(
        base, "d", PROMPTS, run, tmp_path, start_together=True
    )
    assert differing == [] and verdict.passed
    return section


def test_rounds_alternate_on_the_same_prompts_after_the_full_passes(
    start: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    pair = Pair(start)
    section = _evaluate(pair, monkeypatch, tmp_path)
    full = [s for s, kind in pair.events if kind == "full"]
    assert full == ["baseline"] * 6 + ["drafter"] * 6  # one full pass each, in turn
    timed = [s for s, kind in pair.events if kind == "round"]
    assert len(timed) == 5 * 2 * pair.per_round and pair.per_round == 2
    runs = [timed[i] for i in range(0, len(timed), pair.per_round)]  # one entry per server run
    assert runs == ["baseline", "drafter", "drafter", "baseline"] * 2 + ["baseline", "drafter"]
    assert section["speedup_rounds"] == pytest.approx([2.0] * 5)  # 0.16 s vs 0.08 s a round
    assert section["speedup_trusted"] is True and section["speedup_spread"] == pytest.approx(0)
    assert section["speedup"] == pytest.approx(2.0)
    assert section["tokens_per_s"] == pytest.approx(16 / 0.08)
    assert section["tokens_per_s_baseline"] == pytest.approx(16 / 0.16)


def test_a_round_disturbed_on_one_side_spreads_the_ratios_and_gives_no_figure(
    start: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Round 2 of 5: the drafter's server 4x slower (other work landed on the machine then): its
    ratio 0.5 against 2 elsewhere; the median alone would hide it, the spread does not."""
    pair = Pair(start, slow_rounds={2: 4.0})
    section = _evaluate(pair, monkeypatch, tmp_path)
    assert section["speedup_rounds"] == pytest.approx([2.0, 2.0, 0.5, 2.0, 2.0])
    assert section["speedup"] is None and section["speedup_trusted"] is False
    assert section["speedup_spread"] == pytest.approx(1.5 / 2.0)
    assert (
        "from x0.50 to x2.00, a spread of 0.75 above evaluate.speedup_max_spread=0.25"
        in (section["speedup_note"])
    )
    assert section["tokens_per_s"] == pytest.approx(200.0)  # the median round's, still there


def test_a_tighter_limit_is_honoured(
    start: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A round 10% slow: trusted at the default 0.25, not at evaluate.speedup_max_spread 0.05."""
    section = _evaluate(Pair(start, slow_rounds={4: 1.1}), monkeypatch, tmp_path)
    assert section["speedup"] == pytest.approx(2.0) and section["speedup_trusted"] is True
    strict = _evaluate(
        Pair(start, slow_rounds={4: 1.1}), monkeypatch, tmp_path, speedup_max_spread=0.05
    )
    assert strict["speedup"] is None and strict["speedup_spread"] == pytest.approx(0.2 / 2.2)
