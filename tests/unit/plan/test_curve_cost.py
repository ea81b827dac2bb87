"""The learning curve as a plan: predictions -> training tokens, samples, disk and hours; one
more epoch against 2x the data, side by side; a curve costed only for its own verifier."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
from builders import fake_verifier
from plan_cases import KIMI, PROFILE, kimi_plan

from eagle3_pipeline.config.params import Params
from eagle3_pipeline.core import paths
from eagle3_pipeline.evaluation import learning_curve as lc
from eagle3_pipeline.plan import curve_cost, report

FIT = lc.Fit(a=-9.0, b=0.7, k=3)


def _curve() -> dict:
    tokens = 400_000
    return {
        "num_speculative_tokens": 3,
        "fit": {"a": FIT.a, "b": FIT.b, "fitted_on": [0.25, 0.5, 1.0]},
        "points": [
            {
                "fraction": 0.5,
                "train_samples": 800,
                "train_tokens": 200_000,
                "tau": FIT.tau(2e5),
                "epochs": {"tau_by_epoch": [1.2, 1.4, 1.3], "peak_epoch": 1},
            },
            {"fraction": 1.0, "train_samples": 1600, "train_tokens": tokens, "tau": FIT.tau(4e5)},
        ],
        "check": None,
        "predictions": [
            {
                "data_multiple": m,
                "train_tokens": int(tokens * m),
                "tau": FIT.tau(tokens * m),
                "interval": [FIT.tau(tokens * m) - 0.1, FIT.tau(tokens * m) + 0.1],
            }
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
    # Side by side, from this run: train reruns all 3 epochs, or 2 epochs on twice the rows.
    epoch, data = plan.trade
    assert (epoch.label, data.label) == ("+1 epoch (3)", "2x the data")
    assert epoch.gain == pytest.approx(0.1) and "at most +0.100" in epoch.buys
    assert epoch.hours["store"] == pytest.approx(3 * 400_000 / 800 / 3600)
    assert epoch.hours["online"] == pytest.approx((3 * 400_000 / 800 + 3 * 400_000 / 2_000) / 3600)
    assert data.gain == pytest.approx(FIT.tau(8e5) - FIT.tau(4e5))
    added = 400_000 / 0.8  # the added rows' tokens, val made too
    generate = added * 0.75 / plan.rates.generate
    assert data.hours["store"] == pytest.approx((generate + added / 2_000 + 1_600_000 / 800) / 3600)
    assert data.hours["online"] == pytest.approx(
        (generate + 1_600_000 / 800 + 1_600_000 / 2_000) / 3600
    )
    assert plan.peaks == "val acceptance peaks: fraction 0.5 at epoch 2 of 3"
    assert data.buys.endswith(f"-> {FIT.tau(8e5):.3f} (the fit)")
    # A curve with a bend names its 2x prediction beside the line's.
    bent = _curve() | {"bend": {"predictions": [{"data_multiple": 2.0, "tau": 2.345}]}}
    data = curve_cost.curve_plan(params, bent, None).trade[1]
    assert data.buys.endswith(f"-> {FIT.tau(8e5):.3f} (the fit; the bend: 2.345)")


def test_without_a_run_the_reference_rates_are_said(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    plan = curve_cost.curve_plan(Params(), _curve(), target_tau=9.0)  # 9 > k + 1: no row
    assert "this run's own" not in plan.rates.source and len(plan.rows) == 2
    assert curve_cost.load(tmp_path / "metrics/curve.json") is None


def test_one_more_epoch_buys_nothing_past_the_peak_and_a_target_past_k_is_said(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    curve = _curve()
    curve["epochs"] = {"tau_by_epoch": [1.5, 1.9, 1.8], "peak_epoch": 1}
    plan = curve_cost.curve_plan(Params(), curve, target_tau=4.5)
    assert plan.trade[0].gain == 0.0 and plan.trade[0].buys == "none: val peaked at epoch 2 of 3"
    assert plan.notes == [
        "target tau 4.5: never reached: 3 drafts accept at most 4 (evaluate.num_speculative_tokens)"
    ]
    curve["epochs"] = {"tau_by_epoch": [1.5], "peak_epoch": 0}
    assert curve_cost.curve_plan(Params(), curve, None).trade[0].gain is None


# The Kimi plan reads tests/fixtures/kimi-k2.5/config.json (--verifier-config): a copy standing
# in for the verifier's own, so a curve is compared by name and shape, or by the same bytes.
KIMI_RECORD = {
    "name_or_path": "moonshotai/Kimi-K2.5",
    "revision": None,
    "config_sha256": "0" * 64,  # another copy of the config: other bytes
    "model_type": "deepseek_v3",
    "num_hidden_layers": 61,
    "hidden_size": 7168,
    "vocab_size": 163840,
}


def _kimi_with(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, verifier: dict[str, Any] | None, **kw: Any
):
    curve = _curve() | ({"verifier": verifier} if verifier is not None else {})
    (tmp_path / "curve.json").write_text(json.dumps(curve))
    monkeypatch.setattr(paths, "CURVE", tmp_path / "curve.json")
    return kimi_plan(**kw)


def test_a_curve_of_the_planned_verifier_is_costed_by_name_and_shape(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    p = _kimi_with(monkeypatch, tmp_path, KIMI_RECORD, target_tau=FIT.tau(1e6))
    assert p.curve is not None and p.curve_notes == []
    assert [r.label for r in p.curve.rows] == ["2x data", "10x data", f"tau {FIT.tau(1e6):g}"]
    assert p.curve.fitted_on.startswith(
        "fitted on moonshotai/Kimi-K2.5 (deepseek_v3, 61 layers, hidden 7168, vocab 163840): "
        "this plan's verifier (compared: name, model type, layers, hidden size, vocab; not the "
        f"config hash: planned from {KIMI}"
    )
    text = report.render(p)
    assert "+1 epoch (6)" in text and "2x the data" in text


def test_a_curve_of_the_same_config_bytes_is_costed_by_its_hash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    same = hashlib.sha256(KIMI.read_bytes()).hexdigest()
    p = _kimi_with(monkeypatch, tmp_path, KIMI_RECORD | {"config_sha256": same})
    assert p.curve is not None
    assert p.curve.fitted_on == (
        f"fitted on this verifier: moonshotai/Kimi-K2.5, config.json sha256 {same[:12]} "
        f"(compared: the config hash of {KIMI})"
    )


def test_a_curve_of_another_verifier_is_refused_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tiny = KIMI_RECORD | {"name_or_path": "data/verifier", "model_type": "llama"}
    p = _kimi_with(monkeypatch, tmp_path, tiny | {"num_hidden_layers": 8}, target_tau=2.0)
    assert p.curve is None and len(p.curve_notes) == 1
    assert p.curve_notes[0].startswith(
        f"target tau 2: {tmp_path / 'curve.json'}: fitted on another verifier: name "
        "data/verifier there, moonshotai/Kimi-K2.5 here (compared: name, model type, layers, "
        f"hidden size, vocab; not the config hash: planned from {KIMI}"
    )
    assert p.curve_notes[0].endswith(
        "not costed: set curve.fractions and run the curve stage on this verifier"
    )
    layers = _kimi_with(monkeypatch, tmp_path, KIMI_RECORD | {"num_hidden_layers": 60})
    assert "fitted on another verifier: layers 60 there, 61 here" in layers.curve_notes[0]
    assert f"curve       {p.curve_notes[0]}" in report.render(p).splitlines()


def test_a_curve_without_its_verifier_is_unknown_provenance(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    p = _kimi_with(monkeypatch, tmp_path, None)
    assert p.curve is None
    assert p.curve_notes == [
        f"{tmp_path / 'curve.json'}: does not record the verifier it was fitted on (unknown "
        "provenance): not costed: rerun the curve stage (dvc repro curve), which records it"
    ]


def test_the_verifiers_own_config_is_compared_by_its_hash(tmp_path: Path) -> None:
    own = fake_verifier(tmp_path, {"model_type": "llama", "num_hidden_layers": 8}) / "config.json"
    planned = curve_cost.PlannedVerifier("data/verifier", own, True, {"model_type": "llama"})
    ours = hashlib.sha256(own.read_bytes()).hexdigest()
    record = {"name_or_path": "data/verifier", "config_sha256": ours, "model_type": "llama"}
    assert curve_cost.provenance({"verifier": record}, planned, own).same
    # Same name and shape, other bytes (a rebuilt verifier): another verifier.
    other = curve_cost.provenance({"verifier": record | {"config_sha256": "f" * 64}}, planned, own)
    assert not other.same
    assert f"config.json sha256 ffffffffffff there, {ours[:12]} at {own}" in other.line
    assert "(compared: the config hash)" in other.line


def test_no_fitted_curve_is_said_where_a_target_asks_for_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    planned = curve_cost.PlannedVerifier("v", None, False, {})
    path = tmp_path / "curve.json"
    assert curve_cost.plan_curve(Params(), 2.0, planned, path) == (
        None,
        [f"target tau 2: {path} not found (set curve.fractions and run the curve stage)"],
    )
    path.write_text(json.dumps({"fit": None, "points": [], "epochs": {"tau_by_epoch": []}}))
    assert curve_cost.plan_curve(Params(), 2.5, planned, path) == (
        None,
        [
            f"target tau 2.5: no fitted learning curve in {path} (set curve.fractions and run "
            "the curve stage)"
        ],
    )
    assert curve_cost.plan_curve(Params(), None, planned, path) == (None, [])


def test_kimi_plan_without_a_fit_says_so_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """As on a fresh clone: metrics/curve.json of a run without fractions (epochs, no fit)."""
    from eagle3_pipeline.cli import main

    unfitted = {"fit": None, "points": [], "predictions": None, "check": None}
    (tmp_path / "curve.json").write_text(json.dumps(unfitted | {"num_speculative_tokens": 3}))
    monkeypatch.setattr(paths, "CURVE", tmp_path / "curve.json")
    assert main(["plan", "--params", str(PROFILE), "--target-tau", "2.0"]) == 0
    curve = [line for line in capsys.readouterr().out.splitlines() if line.startswith("curve")]
    assert curve == [
        f"curve       target tau 2: no fitted learning curve in {tmp_path / 'curve.json'} (set "
        "curve.fractions and run the curve stage)"
    ]
