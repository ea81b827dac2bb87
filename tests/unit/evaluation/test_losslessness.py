"""The losslessness verdict: identical, near ties (pass, recorded) and sure divergences (fail)."""

from __future__ import annotations

import pytest

from eagle3_pipeline.evaluation import losslessness as ll
from eagle3_pipeline.evaluation.losslessness import TokenLogprobs as T

TOL = 0.1


def lp(token: int, **top: float) -> T:
    """Token `token` chosen; `top` as t<id>=logprob, the chosen one included."""
    table = {int(k[1:]): v for k, v in top.items()}
    return T(token, table[token], table)


def judge(baseline, spec, b_lp, s_lp, prompts=None):
    prompts = prompts or [f"p{i}" for i in range(len(baseline))]
    return ll.judge(prompts, baseline, spec, b_lp, s_lp, TOL, 5)


def test_identical_outputs() -> None:
    v = judge([[1, 2], [3]], [[1, 2], [3]], [None, None], [None, None])
    assert v.outcome == "identical" and v.passed
    assert v.section()["num_identical"] == 2 and v.section()["near_tie_positions"] == []


def test_swap_at_a_near_tie_passes_and_is_recorded() -> None:
    # position 1: baseline picks 5 over 6 by 0.03 nats, the drafter run picks 6 over 5
    base = [lp(1, t1=-0.1, t9=-3.0), lp(5, t5=-0.70, t6=-0.73), lp(7, t7=-0.2)]
    spec = [lp(1, t1=-0.1, t9=-3.0), lp(6, t6=-0.70, t5=-0.72), lp(8, t8=-0.1)]
    v = judge([[1, 5, 7], [2]], [[1, 6, 8], [2]], [base, None], [spec, None])
    assert v.outcome == "near_ties" and v.passed
    (d,) = v.near_ties
    assert (d.prompt, d.position, d.baseline_token, d.spec_token) == ("p0", 1, 5, 6)
    assert d.margin_nats == pytest.approx(0.03)
    section = v.section()
    assert section["num_near_ties"] == 1 and section["num_identical"] == 1
    assert section["near_tie_positions"][0]["margin_nats"] == pytest.approx(0.03)
    assert section["near_tie_nats"] == TOL and section["top_logprobs"] == 5


def test_divergence_where_the_baseline_was_sure_fails() -> None:
    base = [lp(5, t5=-0.1, t6=-2.4)]  # 2.3 nats: the verifier was sure
    spec = [lp(6, t6=-0.1, t5=-2.4)]
    v = judge([[5]], [[6]], [base], [spec], prompts=["row-17"])
    assert v.outcome == "diverged" and not v.passed
    (d,) = v.diverged
    assert d.margin_nats == pytest.approx(2.3)
    assert "row-17 at generated token 0" in d.describe() and "2.300 nats" in d.describe()


def test_token_outside_the_other_top_k_fails_even_at_a_small_margin() -> None:
    base = [lp(5, t5=-0.70, t6=-0.72)]
    spec = [lp(6, t6=-0.70, t9=-0.71)]  # the baseline's token is not in the spec's top-k
    assert judge([[5]], [[6]], [base], [spec]).outcome == "diverged"
    base = [lp(5, t5=-0.70, t9=-0.72)]  # the spec's token is not in the baseline's top-k
    spec = [lp(6, t6=-0.70, t5=-0.71)]
    v = judge([[5]], [[6]], [base], [spec])
    assert v.outcome == "diverged" and v.diverged[0].margin_nats is None


def test_margin_equal_to_tolerance_passes_just_above_fails() -> None:
    spec = [lp(6, t6=-0.5, t5=-0.5)]
    assert judge([[5]], [[6]], [[lp(5, t5=-0.5, t6=-0.6)]], [spec]).passed
    assert not judge([[5]], [[6]], [[lp(5, t5=-0.5, t6=-0.61)]], [spec]).passed


def test_without_logprobs_any_difference_fails() -> None:
    v = judge([[1, 2]], [[1, 3]], [None], [None])
    assert v.outcome == "diverged" and v.diverged[0].position == 1
    assert v.diverged[0].margin_nats is None and "unknown" in v.diverged[0].describe()


def test_one_output_a_prefix_of_the_other_is_a_divergence() -> None:
    v = judge([[1, 2]], [[1, 2, 3]], [None], [None])
    assert v.outcome == "diverged" and v.diverged[0].position == 2


def test_one_sure_divergence_outweighs_near_ties() -> None:
    near_b, near_s = [lp(5, t5=-0.70, t6=-0.73)], [lp(6, t6=-0.70, t5=-0.72)]
    sure_b, sure_s = [lp(5, t5=-0.1, t6=-4.0)], [lp(6, t6=-0.1, t5=-4.0)]
    v = judge([[5], [5]], [[6], [6]], [near_b, sure_b], [near_s, sure_s])
    assert v.outcome == "diverged"
    assert [d.prompt for d in v.near_ties] == ["p0"] and [d.prompt for d in v.diverged] == ["p1"]


def test_parse_logprobs_reads_token_ids() -> None:
    choice = {
        "logprobs": {
            "content": [
                {
                    "token": "token_id:12",
                    "logprob": -0.5,
                    "top_logprobs": [
                        {"token": "token_id:12", "logprob": -0.5},
                        {"token": "token_id:40", "logprob": -1.5},
                    ],
                }
            ]
        }
    }
    assert ll.parse_logprobs(choice) == [T(12, -0.5, {12: -0.5, 40: -1.5})]
    assert ll.parse_logprobs({"logprobs": None}) is None
    assert ll.parse_logprobs({}) is None
