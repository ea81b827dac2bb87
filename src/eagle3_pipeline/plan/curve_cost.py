"""The learning curve as a plan: a predicted acceptance -> samples, disk, prefill and hours.

Reads metrics/curve.json (the curve stage) where a run made one. Each prediction (curve.predict_at
times the data) and `--target-tau` becomes training tokens (the fit's inverse), then samples at
this run's mean tokens per training sample, the disk and verifier prefill of both hidden-state
modes (modes.scale_cost) and hours: generate + extract + train, at this run's own throughputs
(each stage's provenance duration over the tokens it handled) where it has them, else at the
reference rates of nodes.RATES (said so). Beside it, the trade between more epochs and more
data: what the last epoch added and one more costs, against what 2x the data buys and costs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3_pipeline.config.params import Params
from eagle3_pipeline.core import paths
from eagle3_pipeline.evaluation import learning_curve as lc
from eagle3_pipeline.plan import modes, nodes


@dataclass(frozen=True)
class Rates:
    """Tokens/s of the stages a larger data set reruns, and where the figures come from."""

    generate: float  # supervised (answer) tokens generated per second
    extract: float  # sample tokens prefilled and stored per second
    train: float  # training tokens per second (one epoch's tokens x epochs / duration)
    source: str


@dataclass(frozen=True)
class CurveRow:
    label: str
    tau: float
    interval: tuple[float, float] | None
    train_tokens: int
    scale: modes.ScaleCost
    hours: dict[str, float]  # generate, extract, train (store), train_online


@dataclass(frozen=True)
class CurvePlan:
    tau_now: float
    tokens_now: int
    samples_now: int
    check: dict[str, Any] | None
    rows: list[CurveRow]
    rates: Rates
    epochs: list[str]  # the epochs-or-data lines


def load(path: Path = paths.CURVE) -> dict[str, Any] | None:
    """metrics/curve.json with a fitted curve; None before a curve run (or without fractions)."""
    if not path.is_file():
        return None
    curve = json.loads(path.read_text())
    return curve if curve.get("fit") else None


def measured_rates(params: Params, full: dict[str, Any]) -> Rates:
    """This run's tokens/s from its stages' provenance durations, else nodes.RATES' figures."""
    durations = {}
    for stage in ("generate", "extract", "train"):
        rec = paths.PROVENANCE / f"{stage}.json"
        if rec.is_file():
            durations[stage] = float(json.loads(rec.read_text()).get("duration_s") or 0)
    supervised = _supervised_tokens()
    manifest = paths.HIDDEN_STATES / "manifest.json"
    stored = json.loads(manifest.read_text()).get("num_tokens") if manifest.is_file() else None
    if all(durations.get(s) for s in ("generate", "extract", "train")) and supervised and stored:
        return Rates(
            supervised / (1 - params.prepare.val_ratio) / durations["generate"],
            stored / durations["extract"],
            full["train_tokens"] * params.train.epochs / durations["train"],
            "this run's own throughputs (metrics/provenance durations)",
        )
    ref = nodes.rates_for(params)
    decode = ref.decode_per_request * params.generate.concurrency
    return Rates(decode, ref.extract_per_node, ref.train_per_rank, ref.source)


def curve_plan(params: Params, curve: dict[str, Any], target_tau: float | None) -> CurvePlan:
    k = curve["num_speculative_tokens"]
    f = lc.Fit(curve["fit"]["a"], curve["fit"]["b"], k)
    full = next(p for p in curve["points"] if p["fraction"] == 1.0)
    per_sample = full["train_tokens"] / max(full["train_samples"], 1)
    rates = measured_rates(params, full)
    answer_share = _answer_share(full["train_tokens"])
    wanted = [
        (f"{p['data_multiple']:g}x data", p["tau"], tuple(p["interval"]), p["train_tokens"])
        for p in curve.get("predictions") or []
    ]
    if target_tau is not None:
        tokens = f.tokens_for(target_tau)
        if tokens is not None:
            wanted.append((f"tau {target_tau:g}", target_tau, None, round(tokens)))
    rows = []
    for label, tau, interval, tokens in wanted:
        samples = max(round(tokens / per_sample), 1)
        total = round(tokens / (1 - params.prepare.val_ratio))  # val samples are made too
        scale = modes.scale_cost(
            params, round(samples / (1 - params.prepare.val_ratio)), total, label
        )
        hours = {
            "generate": total * answer_share / rates.generate / 3600,
            "extract": total / rates.extract / 3600,
            "train": tokens * params.train.epochs / rates.train / 3600,
        }
        hours["train_online"] = hours["train"] + scale.online.prefill_tokens / rates.extract / 3600
        rows.append(CurveRow(label, tau, interval, tokens, scale, hours))
    return CurvePlan(
        full["tau"],
        full["train_tokens"],
        full["train_samples"],
        curve.get("check"),
        rows,
        rates,
        _epoch_lines(params, curve, rates, full),
    )


def _epoch_lines(
    params: Params, curve: dict[str, Any], rates: Rates, full: dict[str, Any]
) -> list[str]:
    taus = (curve.get("epochs") or {}).get("tau_by_epoch") or []
    two = next((p for p in curve.get("predictions") or [] if p["data_multiple"] == 2.0), None)
    lines = []
    epoch_h = full["train_tokens"] / rates.train / 3600
    if len(taus) >= 2:
        gain = taus[-1] - taus[-2]
        peak = curve["epochs"]["peak_epoch"] + 1
        where = "still rising" if peak == len(taus) else f"peaked at epoch {peak}"
        lines.append(
            f"epochs: {where}; epoch {len(taus)} added {gain:+.3f} (val, teacher-forced): one "
            f"more epoch on this data, at most about that, costs {epoch_h:.2f} h of training"
        )
    if two is not None:
        extra = _answer_share(full["train_tokens"])
        more = full["train_tokens"] / (1 - params.prepare.val_ratio)
        cost = (
            more * extra / rates.generate
            + more / rates.extract
            + full["train_tokens"] * (2 * params.train.epochs - params.train.epochs) / rates.train
        ) / 3600
        lines.append(
            f"data: 2x the data buys {two['tau'] - full['tau']:+.3f} ({full['tau']:.3f} -> "
            f"{two['tau']:.3f}) for {cost:.2f} h (generate + extract + train, store mode)"
        )
    return lines


def _supervised_tokens() -> int | None:
    """The supervised tokens of the training rows (the vocab stage's frequencies)."""
    freq = paths.TOKEN_FREQ
    if not freq.is_file():
        return None
    return sum(int(n) for n in json.loads(freq.read_text()).values())


def _answer_share(train_tokens: int) -> float:
    """The share of a sample's tokens the verifier generates (the answer): this run's."""
    supervised = _supervised_tokens()
    return min(supervised / train_tokens, 1.0) if supervised and train_tokens else 0.8
