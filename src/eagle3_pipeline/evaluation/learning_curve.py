"""The learning curve's arithmetic: mean acceptance length against training tokens.

Form: the per-draft acceptance `alpha` that gives the measured mean acceptance length at k drafts
(tau = 1 + alpha + ... + alpha^k, as if each draft token were accepted independently) has a
logit linear in ln(training tokens). It is bounded (tau stays within [1, k + 1] however far it
extrapolates, where a line in ln(tokens) would pass k + 1), it has two parameters (three points
leave one degree of freedom, and the smaller fractions alone predict the largest), and it is
what data-scaling curves of classifiers' accuracy look like in practice.

The bend: the same logit, quadratic in ln(training tokens), reported beside the line. Both
real-model recipes' curves bent upward at 2x, and one within its own points, where the line
predicted 0.14 and 0.22 short (docs/learning-curve.md, "Checked out of sample"): the line reads
as a floor, the bend as the estimate where the curve bends within the points measured.

Intervals: a bootstrap over the val samples (every point resampled alike: they are measured on
the same samples), refitting each resample. That is the measurement's noise only; a training
seed's and the form's own error are not in it, which is why the curve stage also reports how
well the smaller fractions predicted the largest.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

EPS = 1e-6  # alpha kept inside (0, 1): a point at tau = 1 or k + 1 has an infinite logit


@dataclass(frozen=True)
class Point:
    """One trained drafter measured: its training data and per-val-sample draft counts."""

    fraction: float  # 1.0: the full run (`train`)
    train_samples: int
    train_tokens: int
    drafts: Sequence[int]  # per val sample: drafts simulated (one per supervised start)
    accepted: Sequence[int]  # per val sample: draft tokens accepted

    @property
    def tau(self) -> float:
        return tau_of(sum(self.drafts), sum(self.accepted))


@dataclass(frozen=True)
class Fit:
    a: float
    b: float  # logit(alpha) = a + b * ln(tokens)
    k: int

    def tau(self, tokens: float) -> float:
        return tau_from_alpha(_sigmoid(self.a + self.b * math.log(tokens)), self.k)

    def tokens_for(self, tau: float) -> float | None:
        """Training tokens at which the fit reaches `tau`; None where it never does."""
        if not 1.0 < tau < self.k + 1 or self.b <= 0:
            return None
        return math.exp((_logit(alpha_of(tau, self.k)) - self.a) / self.b)


@dataclass(frozen=True)
class Bend:
    c: tuple[float, float, float]  # logit(alpha) = c[0] + c[1] x + c[2] x^2, x = ln(tokens)
    k: int

    def tau(self, tokens: float) -> float:
        x = math.log(tokens)
        return tau_from_alpha(_sigmoid(self.c[0] + self.c[1] * x + self.c[2] * x * x), self.k)


def tau_of(drafts: float, accepted: float) -> float:
    """Mean acceptance length, as vLLM counts it (evaluation/acceptance.py)."""
    return 1.0 + accepted / drafts if drafts else 1.0


def tau_from_alpha(alpha: float, k: int) -> float:
    return sum(alpha**j for j in range(k + 1))


def alpha_of(tau: float, k: int) -> float:
    """The alpha in [0, 1] with tau_from_alpha(alpha, k) = tau (bisection: it is increasing)."""
    lo, hi = 0.0, 1.0
    tau = min(max(tau, 1.0), k + 1.0)
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if tau_from_alpha(mid, k) < tau else (lo, mid)
    return (lo + hi) / 2


def fit(tokens: Sequence[float], taus: Sequence[float], k: int) -> Fit:
    """Least squares of logit(alpha) on ln(tokens); needs two distinct token counts."""
    if len(set(tokens)) < 2:
        raise ValueError("a fit needs points at two or more token counts")
    x = np.log(np.asarray(tokens, dtype=float))
    y = np.array([_logit(alpha_of(t, k)) for t in taus])
    b, a = np.polyfit(x, y, 1)
    return Fit(float(a), float(b), k)


def fit_points(points: Sequence[Point], k: int) -> Fit:
    return fit([p.train_tokens for p in points], [p.tau for p in points], k)


def fit_bend(tokens: Sequence[float], taus: Sequence[float], k: int) -> Bend:
    """Least squares of logit(alpha) on ln(tokens) and its square; needs three distinct token
    counts (three points: the parabola through them)."""
    if len(set(tokens)) < 3:
        raise ValueError("a bend needs points at three or more token counts")
    # Centred on the points' mean ln(tokens): the squares of ~13 are ill-conditioned raw.
    x = np.log(np.asarray(tokens, dtype=float))
    m = float(x.mean())
    y = np.array([_logit(alpha_of(t, k)) for t in taus])
    c2, c1, c0 = (float(v) for v in np.polyfit(x - m, y, 2))
    return Bend((c0 - c1 * m + c2 * m * m, c1 - 2 * c2 * m, c2), k)


FORMS = {"line": fit, "bend": fit_bend}
MIN_TOKEN_COUNTS = {"line": 2, "bend": 3}


def bootstrap(
    points: Sequence[Point],
    k: int,
    at_tokens: Sequence[float],
    resamples: int,
    confidence: float,
    seed: int = 0,
    form: str = "line",
) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """(interval of each point's tau, interval of the `form` fit's tau at each of `at_tokens`),
    from `resamples` resamples of the val samples, the same indices for every point (and, for
    one seed, for every form)."""
    n = len(points[0].drafts)
    if any(len(p.drafts) != n for p in points):
        raise ValueError("every point must be measured on the same val samples")
    rng = np.random.default_rng(seed)
    drafts = np.array([p.drafts for p in points], dtype=float)  # [points, samples]
    accepted = np.array([p.accepted for p in points], dtype=float)
    tokens = [p.train_tokens for p in points]
    point_taus, predicted = [], []
    for _ in range(resamples):
        idx = rng.integers(0, n, n)
        d, a = drafts[:, idx].sum(1), accepted[:, idx].sum(1)
        taus = [tau_of(di, ai) for di, ai in zip(d, a, strict=True)]
        point_taus.append(taus)
        if len(set(tokens)) >= MIN_TOKEN_COUNTS[form]:
            f = FORMS[form](tokens, taus, k)
            predicted.append([f.tau(t) for t in at_tokens])
    lo_q, hi_q = (1 - confidence) / 2, (1 + confidence) / 2

    def interval(values: np.ndarray) -> list[tuple[float, float]]:
        if values.size == 0:
            return []
        lo, hi = np.quantile(values, [lo_q, hi_q], axis=0)
        return [(float(x), float(y)) for x, y in zip(lo, hi, strict=True)]

    return interval(np.array(point_taus)), interval(np.array(predicted))


def peak_epoch(taus: Sequence[float]) -> int | None:
    """The epoch (0-based) with the highest val acceptance; the first of equals."""
    return int(np.argmax(taus)) if len(taus) else None


def prediction_at(
    curve: dict[str, Any], multiple: float, form: str = "line"
) -> dict[str, Any] | None:
    """A curve result's (metrics/curve.json) `form` prediction at `multiple` times the full
    run's tokens; None where it has none."""
    predictions = (
        curve.get("predictions") if form == "line" else (curve.get(form) or {}).get("predictions")
    )
    return next((p for p in predictions or [] if p["data_multiple"] == multiple), None)


def summary_lines(curve: dict[str, Any]) -> list[str]:
    """The curve in a few log lines (the stage's log and the end-of-run summary)."""
    lines = []
    for p in curve["points"]:
        lo, hi = p["tau_interval"]
        name = "full run" if p["fraction"] == 1.0 else f"fraction {p['fraction']}"
        lines.append(
            f"{name}: {p['train_samples']} samples, {p['train_tokens']:,} tokens: mean "
            f"acceptance length {p['tau']:.3f} [{lo:.3f}, {hi:.3f}]"
        )
    check = curve.get("check")
    if check:
        lines.append(
            f"fitted on fractions {', '.join(map(str, check['fitted_on']))}: predicted "
            f"{check['predicted']:.3f} at the full run's {check['train_tokens']:,} tokens, "
            f"measured {check['measured']:.3f} (difference {check['difference']:+.3f})"
        )
    for pr in curve.get("predictions") or []:
        lo, hi = pr["interval"]
        lines.append(
            f"{pr['data_multiple']:g}x the data ({pr['train_tokens']:,} tokens): predicted "
            f"{pr['tau']:.3f} [{lo:.3f}, {hi:.3f}] ({curve['confidence']:.0%} interval, val "
            "resampled)"
        )
    bend = curve.get("bend")
    if bend:
        check = bend.get("check")
        if check:
            lines.append(
                f"the bend ({bend['bends']}), fitted on fractions "
                f"{', '.join(map(str, check['fitted_on']))}: predicted {check['predicted']:.3f} "
                f"at the full run's tokens, measured {check['measured']:.3f} (difference "
                f"{check['difference']:+.3f})"
            )
        for pr in bend["predictions"]:
            lo, hi = pr["interval"]
            lines.append(
                f"{pr['data_multiple']:g}x the data: the bend predicts {pr['tau']:.3f} "
                f"[{lo:.3f}, {hi:.3f}]"
            )
    ep = curve.get("epochs")
    if ep and ep["tau_by_epoch"]:
        taus = ", ".join(f"{t:.3f}" for t in ep["tau_by_epoch"])
        lines.append(
            f"val acceptance by epoch: {taus} (peak at epoch {ep['peak_epoch'] + 1} of "
            f"{len(ep['tau_by_epoch'])})"
        )
    return lines


def _logit(alpha: float) -> float:
    alpha = min(max(alpha, EPS), 1 - EPS)
    return math.log(alpha / (1 - alpha))


def _sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))
