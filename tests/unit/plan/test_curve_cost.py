"""The learning curve as a plan: predictions -> training tokens, samples, disk and hours."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eagle3_pipeline.config.params import Params
from eagle3_pipeline.evaluation import learning_curve as lc
from eagle3_pipeline.plan import curve_cost

FIT = lc.Fit(a=-9.0, b=0.7, k=3)


def _curve() -> dict:
    tokens = 400_000
    return {
        "num_speculative_tokens": 3,
        "fit": {"a": FIT.a, "b": FIT.b, "fitted_on": [0.25, 0.5, 1.0]},
        "points": [
            {"fraction": 0.5, "train_samples": 800, "train_tokens": 200_000, "tau": FIT.tau(2e5)},
            {"fraction": 1.0, "train_samples": 1600, "train_tokens": tokens, "tau": FIT.tau(4e5)},
        ],
        "check": None,
        "predictions": [
            {"data_multiple": m, "train_tokens": int(tokens * m), "tau": FIT.tau(tokens * m),
             "interval": [FIT.tau(tokens * m) - 0.1, FIT.tau(tokens * m) + 0.1]}
            for m in (2.0, 10.0)
        ],
        "epochs": {"tau_by_epoch": [1.5, 1.8, 1.9], "peak_epoch": 2},
    }


def _run_files(root: Path, durations: dict[str, float]) -> None:
    (root / "metrics/provenance").mkdir(parents=True)
    for stage, seconds in durations.items():
        (root / f"metrics/provenance/{stage}.json").write_text(json.dumps({"duration_s": seconds}))
    (root / "data/tokenized").mkdir(parents=True)
    (root / "data/tokenized/token_freq.json").write_text(json.dumps({"5": 200_000, "7": 100_000}))
    (root / "data/hidden_states").mkdir(parents=True)
    (root / "data/hidden_states/manifest.json").write_text(json.dumps({"num_tokens": 500_000}))


def test_predictions_and_a_target_become_tokens_samples_and_hours(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    _run_files(tmp_path, {"generate": 600.0, "extract": 250.0, "train": 1000.0})
    params = Params.model_validate({"prepare": {"val_ratio": 0.2}, "train": {"epochs": 2}})
    target = FIT.tau(1e6)
    plan = curve_cost.curve_plan(params, _curve(), target)
    assert "this run's own" in plan.rates.source
    # 300k supervised train tokens are 80% of what generate made in 600 s; 500k stored in 250 s;
    # 400k train tokens x 2 epochs in 1000 s.
    assert plan.rates.generate == pytest.approx(300_000 / 0.8 / 600)
    assert (plan.rates.extract, plan.rates.train) == (2_000, 800)
    two, ten, aimed = plan.rows
    assert (two.label, two.train_tokens) == ("2x data", 800_000)
    assert two.scale.samples == round(3200 / 0.8) and two.scale.tokens == 1_000_000
    assert two.hours["extract"] == pytest.approx(1_000_000 / 2_000 / 3600)
    assert two.hours["train"] == pytest.approx(800_000 * 2 / 800 / 3600)
    assert two.hours["generate"] == pytest.approx(1_000_000 * 0.75 / plan.rates.generate / 3600)
    assert two.hours["train_online"] > two.hours["train"]  # its prefill every epoch
    assert aimed.label == f"tau {target:g}" and aimed.train_tokens == pytest.approx(1e6, rel=1e-6)
    assert ten.tau > two.tau
    assert "epoch 3 added +0.100" in plan.epochs[0] and "still rising" in plan.epochs[0]
    assert plan.epochs[1].startswith("data: 2x the data buys")


def test_without_a_run_the_reference_rates_are_said(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    plan = curve_cost.curve_plan(Params(), _curve(), target_tau=9.0)  # 9 > k + 1: no row
    assert "this run's own" not in plan.rates.source and len(plan.rows) == 2
    assert curve_cost.load(tmp_path / "metrics/curve.json") is None
