"""Served figures from vLLM's per-step counts: positions, windows, answer kinds."""

from __future__ import annotations

import pytest

from eagle3_pipeline.evaluation import served
from eagle3_pipeline.evaluation.served import Answer

K = 3


def _answer(accepted: list[int], cut: bool = False, ids: list[int] | None = None, cat: str = ""):
    n = 1 + sum(a + 1 for a in accepted)
    ids = ids if ids is not None else list(range(n))
    return Answer(ids, accepted, [K] * len(accepted), cut, cat)


def test_loops_finds_a_short_period_tail_only() -> None:
    assert served.loops([1, 2, 3] * 30)
    assert served.loops(list(range(100)) + [7] * 50)
    assert not served.loops(list(range(200)))
    # a repeat shorter than the minimum span is not a loop
    assert not served.loops(list(range(100)) + [5, 6] * 10)
    # a long period needs LOOP_REPEATS repeats
    period = list(range(500, 540))
    assert not served.loops(list(range(10)) + period * 2)
    assert served.loops(list(range(10)) + period * 4)


def test_acceptance_counts_every_step_and_each_draft_position() -> None:
    got = served.acceptance([_answer([3, 0, 1]), _answer([2])], K)
    assert got["num_drafts"] == 4 and got["num_accepted_tokens"] == 6
    assert got["mean_acceptance_length"] == pytest.approx(1 + 6 / 4)
    assert got["acceptance_per_position"] == pytest.approx([3 / 4, 2 / 4, 1 / 4])


def test_by_answer_position_puts_a_step_in_the_window_it_starts_in() -> None:
    # steps start at tokens 1, 5, 9, 10 (each step makes accepted + 1 tokens)
    rows = served.by_answer_position([_answer([3, 3, 0, 2])], K, window=8)
    assert [r["tokens"] for r in rows] == [[0, 7], [8, 15]]
    assert [r["num_drafts"] for r in rows] == [2, 2]
    assert rows[0]["mean_acceptance_length"] == pytest.approx(4.0)
    assert rows[1]["mean_acceptance_length"] == pytest.approx(2.0)
    assert [r["num_answers"] for r in rows] == [1, 1]


def test_section_measures_looping_and_cut_answers_apart() -> None:
    looping = _answer([3] * 20, cut=True, ids=[4, 5] * 40)
    cut = _answer([1, 1], cut=True, ids=list(range(5)))
    finished = _answer([0, 0], ids=list(range(3)))
    got = served.section([looping, cut, finished], K, window=64)
    assert [got[k]["count"] for k in ("looping", "cut", "finished", "healthy")] == [1, 1, 1, 2]
    assert got["looping"]["mean_acceptance_length"] == pytest.approx(4.0)
    assert got["healthy"]["mean_acceptance_length"] == pytest.approx(1 + 2 / 4)
    assert got["num_answers"] == 3 and got["num_drafts"] == 24
    assert "by_category" not in got


def test_section_gives_a_kind_with_no_answers_no_acceptance() -> None:
    got = served.section([_answer([1, 2], cut=True, ids=list(range(6)))], K, window=64)
    assert got["looping"] == {
        "count": 0,
        "mean_acceptance_length": None,
        "acceptance_per_position": None,
        "num_drafts": 0,
    }
    assert got["cut"]["mean_acceptance_length"] == pytest.approx(2.5)


def test_section_splits_categories_when_a_set_has_several() -> None:
    got = served.section([_answer([3], cat="math"), _answer([0], cat="code")], K, window=8)
    assert got["by_category"]["math"]["mean_acceptance_length"] == pytest.approx(4.0)
    assert got["by_category"]["code"]["mean_acceptance_length"] == pytest.approx(1.0)


def test_step_counts_read_vllm_s_field_or_none() -> None:
    spec = {"num_spec_tokens": 3, "per_step_accepted": [1, 2], "per_step_drafted": [3, 2]}
    assert served.step_counts({"speculative_decoding": spec}) == ([1, 2], [3, 2])
    assert served.step_counts({"speculative_decoding": None}) is None
    assert served.step_counts(None) is None
    summary_only = {"num_spec_tokens": 3, "acceptance_histogram": [1, 0, 0, 0]}
    assert served.step_counts({"speculative_decoding": summary_only}) is None
