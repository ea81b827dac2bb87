"""The learning curve's arithmetic: alpha <-> tau, the fit, its inversion, the bootstrap."""

from __future__ import annotations

import math

import numpy as np
import pytest

from eagle3_pipeline.evaluation import learning_curve as lc


@pytest.mark.parametrize("k", [1, 3, 5])
def test_alpha_and_tau_are_inverse(k: int) -> None:
    for alpha in (0.0, 0.1, 0.5, 0.9, 1.0):
        assert lc.alpha_of(lc.tau_from_alpha(alpha, k), k) == pytest.approx(alpha, abs=1e-9)
    assert lc.tau_from_alpha(0.5, 3) == pytest.approx(1.875)


def test_fit_recovers_a_curve_of_its_own_form_and_inverts() -> None:
    truth = lc.Fit(a=-6.0, b=0.5, k=3)
    tokens = [1e4, 3e4, 1e5, 3e5]
    f = lc.fit(tokens, [truth.tau(t) for t in tokens], 3)
    assert (f.a, f.b) == pytest.approx((-6.0, 0.5), abs=1e-6)
    assert f.tau(1e6) == pytest.approx(truth.tau(1e6), abs=1e-6)
    assert f.tokens_for(f.tau(2e5)) == pytest.approx(2e5, rel=1e-6)
    assert f.tokens_for(4.0) is None  # never reached: the bound k + 1
    assert 1.0 < f.tau(1e12) < 4.0  # bounded however far it extrapolates


def test_a_fit_needs_two_token_counts() -> None:
    with pytest.raises(ValueError, match="two or more"):
        lc.fit([100, 100], [1.5, 1.6], 3)


def test_the_bend_recovers_a_quadratic_logit_and_extends_the_line() -> None:
    truth = lc.Bend((-20.0, 2.4, -0.07), k=3)
    tokens = [5e4, 1e5, 2e5, 4e5, 8e5]
    b = lc.fit_bend(tokens, [truth.tau(t) for t in tokens], 3)
    assert b.tau(1.6e6) == pytest.approx(truth.tau(1.6e6), abs=1e-6)
    assert b.c == pytest.approx(truth.c, rel=1e-5)
    line = lc.Fit(-6.0, 0.5, 3)
    straight = lc.fit_bend(tokens, [line.tau(t) for t in tokens], 3)
    assert straight.c[2] == pytest.approx(0.0, abs=1e-9)
    assert straight.tau(1e7) == pytest.approx(line.tau(1e7), abs=1e-6)
    with pytest.raises(ValueError, match="three or more"):
        lc.fit_bend([1e4, 2e4, 2e4], [1.5, 1.6, 1.7], 3)


def _point(fraction: float, tokens: int, per_draft: float, n: int = 200, seed: int = 0):
    """Per-sample counts whose pooled acceptance is about `per_draft` of 3 draft tokens."""
    rng = np.random.default_rng(seed)
    drafts = rng.integers(20, 60, n)
    accepted = rng.binomial(drafts * 3, per_draft)
    return lc.Point(fraction, tokens // 100, tokens, drafts.tolist(), accepted.tolist())


def test_bootstrap_intervals_hold_the_point_estimates_and_widen_when_extrapolating() -> None:
    points = [_point(0.25, 25_000, 0.20), _point(0.5, 50_000, 0.26), _point(1.0, 100_000, 0.31)]
    f = lc.fit_points(points, 3)
    point_iv, pred_iv = lc.bootstrap(points, 3, [200_000, 1_000_000], 300, 0.9, seed=1)
    for p, (lo, hi) in zip(points, point_iv, strict=True):
        assert lo <= p.tau <= hi
    (lo2, hi2), (lo10, hi10) = pred_iv
    assert lo2 <= f.tau(200_000) <= hi2
    assert hi10 - lo10 > hi2 - lo2  # further from the data: less known
    again = lc.bootstrap(points, 3, [200_000, 1_000_000], 300, 0.9, seed=1)
    assert again == (point_iv, pred_iv)  # seeded


def test_the_bends_bootstrap_uses_the_same_resamples_and_holds_its_prediction() -> None:
    points = [
        _point(0.125, 12_500, 0.16),
        _point(0.25, 25_000, 0.20),
        _point(0.5, 50_000, 0.26),
        _point(1.0, 100_000, 0.34),
    ]
    b = lc.fit_bend([p.train_tokens for p in points], [p.tau for p in points], 3)
    line_points, _ = lc.bootstrap(points, 3, [200_000], 200, 0.9, seed=2)
    bend_points, ((lo, hi),) = lc.bootstrap(points, 3, [200_000], 200, 0.9, seed=2, form="bend")
    assert bend_points == line_points  # the points' intervals: the same val resamples
    assert lo <= b.tau(200_000) <= hi
    # Three points fit no bend in a resample: no interval, rather than a wrong one.
    assert lc.bootstrap(points[:2], 3, [200_000], 20, 0.9, form="bend")[1] == []


def test_bootstrap_refuses_points_measured_on_other_samples() -> None:
    with pytest.raises(ValueError, match="same val samples"):
        lc.bootstrap([_point(0.5, 10, 0.2, n=10), _point(1.0, 20, 0.3, n=11)], 3, [40], 10, 0.9)


def test_peak_epoch() -> None:
    assert lc.peak_epoch([1.2, 1.8, 1.9, 1.85]) == 2
    assert lc.peak_epoch([]) is None
    assert math.isclose(lc.tau_of(10, 15), 2.5)


def test_a_curves_prediction_at_a_multiple_is_read_per_form() -> None:
    line = [{"data_multiple": 1.5, "tau": 2.1}, {"data_multiple": 2.0, "tau": 2.2}]
    curve = {"predictions": line, "bend": {"predictions": [{"data_multiple": 2.0, "tau": 2.3}]}}
    assert lc.prediction_at(curve, 2.0)["tau"] == 2.2
    assert lc.prediction_at(curve, 2.0, "bend")["tau"] == 2.3
    assert lc.prediction_at(curve, 3.0) is None
    assert lc.prediction_at({"predictions": None, "bend": None}, 2.0, "bend") is None
