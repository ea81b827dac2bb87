"""Stage `curve`: its refusals (a fraction's metrics missing, incomplete or measured on other
samples; a store without val samples), the pruning of fractions no longer listed, the reading
of val acceptance per epoch, and the result's shape on synthetic fraction metrics. The drafters
are never trained nor loaded: `_simulate` (the offline simulation) is replaced by counts."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from builders import fake_verifier, make_params
from train_workspace import build_workspace

from eagle3_pipeline.config.params import Params
from eagle3_pipeline.conversations import split
from eagle3_pipeline.core import paths
from eagle3_pipeline.core.errors import DataError, StoreError, VerifierError
from eagle3_pipeline.evaluation import learning_curve as lc
from eagle3_pipeline.stages import curve

FRACTIONS = [0.25, 0.5]
VAL = [f"v{i:02d}" for i in range(30)]
LLAMA = {"model_type": "llama", "num_hidden_layers": 8, "hidden_size": 64, "vocab_size": 512}
# Draft tokens accepted per val sample (10 drafts each): more with more data.
ACCEPTED = {0.125: 6, 0.25: 8, 0.5: 11, 1.0: 14}


# The learning curve on FRACTIONS, 3 drafts per step, a tenth of the rows as val.
CURVE = {
    "prepare": {"val_ratio": 0.1},
    "evaluate": {"num_speculative_tokens": 3},
    "curve": {"fractions": FRACTIONS, "bootstrap_samples": 20},
}


def _counts(fraction: float) -> curve.Counts:
    return curve.Counts([10] * len(VAL), [ACCEPTED[fraction] + i % 3 for i in range(len(VAL))])


def _fake_simulate(params: Params, verifier, dirs: dict[str, Path], only: set[str] | None = None):
    """Counts as if each drafter were simulated: the fraction's from its folder's name (a
    folder named otherwise counts as the full run's); with `only`, those val samples alone."""
    ids = curve.val_ids(VAL, None, only)
    counts = {}
    for name, folder in dirs.items():
        try:
            got = _counts(1.0 if name == "full" else float(folder.parent.name))
        except ValueError:
            got = _counts(1.0)
        keep = [i for i, sid in enumerate(VAL) if sid in ids]
        counts[name] = curve.Counts([got.drafts[i] for i in keep], [got.accepted[i] for i in keep])
    return ids, counts


@pytest.fixture
def workspace(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """tmp_path as the repo: the verifier's config.json and 400 tokenized training rows."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(curve, "_simulate", _fake_simulate)
    fake_verifier(paths.VERIFIER, LLAMA)
    paths.TOKENIZED.mkdir(parents=True)
    rows = [
        {"id": f"r{i:03d}", "input_ids": [1] * (10 + i % 7), "loss_mask": [0, 1] * 5}
        for i in range(400)
    ]
    (paths.TOKENIZED / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp_path


def _rows_in(fraction: float) -> list[dict]:
    rows = [json.loads(line) for line in (paths.TOKENIZED / "train.jsonl").read_text().splitlines()]
    return [r for r in rows if fraction == 1.0 or split.in_fraction(r["id"], fraction, 0.1)]


def _series(path: Path, taus: list[float]) -> None:
    """A DVCLive series as train writes it: one row per epoch."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = ["timestamp\tstep\tacceptance_length"]
    lines += [f"{1000 + i}\t{i}\t{t}" for i, t in enumerate(taus)]
    path.write_text("\n".join(lines) + "\n")


def _fraction_series(fraction: float) -> Path:
    return paths.CURVE_FRACTIONS / str(fraction) / "train/plots/metrics/val/acceptance_length.tsv"


def _eval(fraction: float) -> Path:
    return paths.CURVE_FRACTIONS / str(fraction) / "eval.json"


def test_measure_records_a_fractions_rows_and_counts(workspace: Path) -> None:
    curve.measure(make_params(CURVE), 0.25)
    record = json.loads(_eval(0.25).read_text())
    rows = _rows_in(0.25)
    assert 0 < len(rows) < 400
    assert record["train_samples"] == len(rows)
    assert record["train_tokens"] == sum(len(r["input_ids"]) for r in rows)
    assert record["supervised_tokens"] == 5 * len(rows)
    assert record["per_sample"]["accepted"][:3] == [8, 9, 10]
    assert record["tau"] == round(1 + sum(_counts(0.25).accepted) / 300, 4) == 1.9


def test_the_result_has_the_fit_the_check_the_predictions_and_the_epochs(
    workspace: Path, capsys
) -> None:
    params = make_params(CURVE)
    for f in FRACTIONS:
        curve.measure(params, f)
    _series(paths.TRAIN_VAL_TAU, [2.0, 2.3, 2.4])
    _series(_fraction_series(0.25), [1.5, 1.7, 1.6])  # 0.5 has no series: no epochs
    curve.run(params)
    result = json.loads(paths.CURVE.read_text())
    points = result["points"]
    assert [p["fraction"] for p in points] == [0.25, 0.5, 1.0]
    assert [p["train_tokens"] for p in points] == [
        sum(len(r["input_ids"]) for r in _rows_in(f)) for f in (0.25, 0.5, 1.0)
    ]
    assert points[-1]["train_samples"] == 400
    assert [p["tau"] for p in points] == [1.9, 2.2, 2.5]
    assert all(lo <= p["tau"] <= hi for p in points for lo, hi in [p["tau_interval"]])
    # Each point keeps the counts it was fitted on, the full run's included, per val sample.
    for p, f in zip(points, (0.25, 0.5, 1.0), strict=True):
        assert p["per_sample"]["accepted"] == _counts(f).accepted
        assert p["per_sample"]["drafts"] == _counts(f).drafts
    assert result["val_ids_sha256"] == hashlib.sha256("\n".join(VAL).encode()).hexdigest()
    assert points[0]["epochs"] == {
        "tau_by_epoch": [1.5, 1.7, 1.6],
        "peak_epoch": 1,
        "peak_tau": 1.7,
    }
    assert points[1]["epochs"] == {"tau_by_epoch": [], "peak_epoch": None, "peak_tau": None}
    assert points[2]["epochs"]["peak_epoch"] == 2
    assert result["epochs"]["tau_by_epoch"] == [2.0, 2.3, 2.4]
    # The fit rises with data; the check predicts the full run from the two fractions.
    assert result["fit"]["fitted_on"] == [0.25, 0.5, 1.0] and result["fit"]["b"] > 0
    check = result["check"]
    assert check["fitted_on"] == [0.25, 0.5] and check["measured"] == 2.5
    assert check["difference"] == round(check["predicted"] - 2.5, 4)
    full_tokens = points[-1]["train_tokens"]
    predictions = result["predictions"]
    assert [(p["data_multiple"], p["train_tokens"]) for p in predictions] == [
        (2.0, 2 * full_tokens),
        (10.0, 10 * full_tokens),
    ]
    assert 2.5 < predictions[0]["tau"] < predictions[1]["tau"] < 4.0
    # The verifier it was measured on: identity and shape.
    config = paths.VERIFIER / "config.json"
    assert result["verifier"] == {
        "name_or_path": "data/verifier",
        "revision": None,
        "config_sha256": hashlib.sha256(config.read_bytes()).hexdigest(),
        **LLAMA,
    }
    # The bend: through three points exactly, its own predictions and intervals; no check
    # (two smaller points do not make one).
    bend = result["bend"]
    assert bend["fitted_on"] == [0.25, 0.5, 1.0] and bend["check"] is None
    fitted = lc.Bend(tuple(bend["c"]), 3)
    for p in points:
        assert fitted.tau(p["train_tokens"]) == pytest.approx(p["tau"], abs=1e-4)
    assert [(p["data_multiple"], p["train_tokens"]) for p in bend["predictions"]] == [
        (p["data_multiple"], p["train_tokens"]) for p in predictions
    ]
    for pr in bend["predictions"]:
        lo, hi = pr["interval"]
        assert lo <= pr["tau"] <= hi and pr["tau"] == round(fitted.tau(pr["train_tokens"]), 4)
    tokens = json.loads(paths.CURVE_TOKENS.read_text())
    assert [t["kind"] for t in tokens] == (
        ["measured"] * 3 + ["predicted"] * 2 + ["predicted (bend)"] * 2
    )
    assert json.loads(paths.CURVE_EPOCHS.read_text())[-1] == {"epoch": 3, "tau": 2.4}
    out = capsys.readouterr().out
    assert (
        "[curve] fraction 0.25: val acceptance by epoch: 1.500, 1.700, 1.600 (peak at epoch 2 of 3)"
        in out
    )
    assert "[curve] fraction 0.5: val acceptance" not in out


def test_the_bend_is_checked_like_the_line_from_three_fractions(workspace: Path, capsys) -> None:
    params = make_params(CURVE, curve={"fractions": [0.125, *FRACTIONS]})
    for f in (0.125, *FRACTIONS):
        curve.measure(params, f)
    curve.run(params)
    result = json.loads(paths.CURVE.read_text())
    taus = [p["tau"] for p in result["points"]]
    tokens = [p["train_tokens"] for p in result["points"]]
    check, line = result["bend"]["check"], result["check"]
    assert check["fitted_on"] == line["fitted_on"] == [0.125, 0.25, 0.5]
    # The parabola through the fractions' three points, at the full run's tokens.
    through = lc.fit_bend(tokens[:3], taus[:3], 3)
    assert check["predicted"] == round(through.tau(tokens[3]), 4)
    assert check["measured"] == taus[3] and check["difference"] == round(
        check["predicted"] - taus[3], 4
    )
    assert result["bend"]["bends"] == ("up" if result["bend"]["c"][2] > 0 else "down")
    out = capsys.readouterr().out
    assert f"[curve] the bend ({result['bend']['bends']}), fitted on fractions 0.125, 0.25" in out
    assert "[curve] 2x the data: the bend predicts" in out


def test_without_fractions_only_the_epochs_and_the_verifier(workspace: Path) -> None:
    (paths.CURVE_FRACTIONS / "0.5").mkdir(parents=True)  # a fraction dropped from the list
    _series(paths.TRAIN_VAL_TAU, [2.0, 2.3, 2.2])
    curve.run(make_params(CURVE, curve={"fractions": []}))
    result = json.loads(paths.CURVE.read_text())
    assert (result["points"], result["fit"], result["predictions"]) == ([], None, None)
    assert result["epochs"]["peak_epoch"] == 1 and result["epochs"]["peak_tau"] == 2.3
    assert result["verifier"]["num_hidden_layers"] == 8
    assert not (paths.CURVE_FRACTIONS / "0.5").exists()


def test_prune_removes_unlisted_fractions_and_keeps_listed_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    monkeypatch.chdir(tmp_path)
    curve._prune_unlisted([0.25])  # no metrics/fractions yet: nothing to do
    for f in ("0.125", "0.25", "0.5"):
        (paths.CURVE_FRACTIONS / f).mkdir(parents=True)
        (paths.CURVE_FRACTIONS / f / "eval.json").write_text("{}")
    (paths.CURVE_FRACTIONS / "notes.txt").write_text("a file, not a fraction's folder")
    curve._prune_unlisted([0.25, 0.75])
    assert sorted(p.name for p in paths.CURVE_FRACTIONS.iterdir()) == ["0.25", "notes.txt"]
    assert (paths.CURVE_FRACTIONS / "0.25" / "eval.json").is_file()
    out = capsys.readouterr().out
    assert "removed metrics/fractions/0.125: fraction 0.125 is no longer in curve.fractions" in out


def _refusal(fraction: float) -> str:
    return f"rerun curve_train@{fraction} (dvc repro -f curve_train@{fraction})"


def test_read_fraction_refuses_missing_or_incomplete_metrics(workspace: Path) -> None:
    params = make_params(CURVE)
    curve.measure(params, 0.5)
    full = json.loads(_eval(0.5).read_text()) | {"fraction": 1.0}
    with pytest.raises(DataError) as missing:
        curve._read_fraction(0.25, full)
    assert str(missing.value) == f"{_eval(0.25)}: not found: run the stage curve_train@0.25"
    _eval(0.25).parent.mkdir(parents=True)
    _eval(0.25).write_text('{"fraction": 0.25, "train_')  # cut off while written
    with pytest.raises(DataError) as cut:
        curve._read_fraction(0.25, full)
    assert str(cut.value) == f"{_eval(0.25)}: not valid JSON (line 1): {_refusal(0.25)}"
    record = json.loads(_eval(0.5).read_text())
    del record["per_sample"]
    _eval(0.25).write_text(json.dumps(record))
    with pytest.raises(DataError) as incomplete:
        curve._read_fraction(0.25, full)
    assert str(incomplete.value) == f"{_eval(0.25)}: incomplete (no per_sample): {_refusal(0.25)}"
    for err in (missing, cut, incomplete):
        assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("key", "value"), [("val_ids_sha256", "0" * 64), ("num_speculative_tokens", 5)]
)
def test_read_fraction_refuses_other_val_samples_or_draft_counts(
    workspace: Path, key: str, value: object
) -> None:
    curve.measure(make_params(CURVE), 0.5)
    full = json.loads(_eval(0.5).read_text()) | {key: value}
    with pytest.raises(DataError) as err:
        curve._read_fraction(0.5, full)
    assert str(err.value) == (
        f"{_eval(0.5)}: measured on other val samples or draft counts than the full run ({key}): "
        f"{_refusal(0.5)}"
    )


def test_run_refuses_a_listed_fraction_not_measured_and_writes_nothing(workspace: Path) -> None:
    params = make_params(CURVE)
    curve.measure(params, 0.25)
    with pytest.raises(DataError, match=r"fractions/0\.5/eval\.json: not found: run the stage "):
        curve.run(params)
    assert not paths.CURVE.exists()


def test_run_refuses_without_the_verifiers_config(workspace: Path) -> None:
    (paths.VERIFIER / "config.json").unlink()
    with pytest.raises(VerifierError, match=r"data/verifier/config\.json: not found"):
        curve.run(make_params(CURVE))
    assert not paths.CURVE.exists()


def test_run_refuses_a_store_without_val_samples(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    verifier = fake_verifier(tmp_path / "verifier", LLAMA)
    root = build_workspace(tmp_path / "ws", verifier, n_train=4, n_val=0)
    monkeypatch.chdir(root)
    manifest = json.loads((paths.HIDDEN_STATES / "manifest.json").read_text())
    for entry in manifest["samples"].values():
        entry["split"] = "train"  # as extract records it: every sample a training one
    (paths.HIDDEN_STATES / "manifest.json").write_text(json.dumps(manifest))
    params = make_params(root / "params.yaml", curve={"fractions": [0.5]})
    with pytest.raises(StoreError) as err:
        curve.run(params)
    assert str(err.value) == f"{paths.HIDDEN_STATES}: no val samples: raise prepare.val_ratio"


def test_val_ids_takes_the_first_ones_or_exactly_those_asked_for() -> None:
    val = ["c", "a", "b", "d"]
    assert curve.val_ids(val, None, None) == ["a", "b", "c", "d"]
    assert curve.val_ids(val, 2, None) == ["a", "b"]
    # an earlier run's val samples: however many, the ones this store holds
    assert curve.val_ids(val, 2, {"d", "b", "x"}) == ["b", "d"]
    with pytest.raises(StoreError, match="no val samples"):
        curve.val_ids([], None, None)


def test_measure_on_an_earlier_runs_val_samples(workspace: Path) -> None:
    got = curve.measure_on(make_params(CURVE), Path("models/drafter"), [*VAL[:10], "gone"])
    assert got["num_samples"] == 10 and got["missing"] == ["gone"]
    accepted = [ACCEPTED[1.0] + i % 3 for i in range(10)]
    assert got["per_sample"] == {"drafts": [10] * 10, "accepted": accepted}
    assert got["tau"] == round(1 + sum(accepted) / 100, 4)


def test_epochs_reads_the_series_and_where_it_peaks(tmp_path: Path) -> None:
    series = tmp_path / "acceptance_length.tsv"
    assert curve._epochs(series) == {"tau_by_epoch": [], "peak_epoch": None, "peak_tau": None}
    _series(series, [1.51234, 1.9, 1.9, 1.7])
    assert curve._epochs(series) == {
        "tau_by_epoch": [1.5123, 1.9, 1.9, 1.7],
        "peak_epoch": 1,  # the first of equals
        "peak_tau": 1.9,
    }
    assert curve._val_tau_series(1.0) == paths.TRAIN_VAL_TAU
    assert curve._val_tau_series(0.25) == _fraction_series(0.25)
