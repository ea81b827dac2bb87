"""evaluation/acceptance.py: the one acceptance formula (vLLM's dashboard definitions)."""

from __future__ import annotations

import pytest

from eagle3_pipeline.evaluation.acceptance import summary


def test_summary() -> None:
    got = summary(drafts=10, draft_tokens=30, accepted=14, accepted_per_pos=[8, 4, 2])
    assert got == {
        "num_drafts": 10,
        "num_draft_tokens": 30,
        "num_accepted_tokens": 14,
        "acceptance_rate": pytest.approx(14 / 30),
        "mean_acceptance_length": pytest.approx(2.4),
        "acceptance_per_position": pytest.approx([0.8, 0.4, 0.2]),
    }


def test_counts_are_ints_even_from_prometheus_floats() -> None:
    got = summary(10.0, 30.0, 14.0, [8.0, 4.0, 2.0])
    assert all(type(got[k]) is int for k in ("num_drafts", "num_draft_tokens"))
    assert type(got["num_accepted_tokens"]) is int


def test_no_drafts_is_neutral() -> None:
    assert summary(0, 0, 0, [0, 0]) == {
        "num_drafts": 0,
        "num_draft_tokens": 0,
        "num_accepted_tokens": 0,
        "acceptance_rate": 0.0,
        "mean_acceptance_length": 1.0,
        "acceptance_per_position": [0.0, 0.0],
    }
