"""The real-model benchmark's record: the served headline, and the 2x run checked against the
first (growth per data stage, the curve's prediction out of sample)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "scripts"))
import real_model_benchmark as bench  # noqa: E402

STAGES = {"synthesize": 400.0, "generate": 800.0, "tokenize": 4.0, "extract": 500.0}
PREDICTED = {"data_multiple": 2.0, "tau": 2.31, "interval": [2.23, 2.39], "train_tokens": 1000}


def _run(stage_s: dict, tau: float, served_tau: float, predictions: list | None = None) -> dict:
    return {
        "stage_s": stage_s,
        "offline_tau": tau,
        "train_tokens": 2000,
        "served": {"sets": {"val": {"tau": served_tau}}},
        "curve": {"predictions": predictions or []},
    }


def test_growth_compares_each_data_stage_with_the_first_run() -> None:
    first = _run(STAGES, 2.08, 1.75, [PREDICTED])
    second = _run(STAGES | {"generate": 440.0, "extract": 275.0, "synthesize": 220.0}, 2.3, 1.9)
    got = bench.grown(first, second)
    stages = got["growth"]["stages"]
    assert stages["generate"] == {"first_s": 800.0, "grown_s": 440.0, "ratio": 0.55}
    assert got["growth"]["generate_extract_ratio"] == pytest.approx(715 / 1300)
    check = got["out_of_sample"]
    assert check["predicted"] == 2.31 and check["measured_offline"] == 2.3
    assert check["inside_interval"] is True
    assert check["served"] == {"first": {"val": {"tau": 1.75}}, "grown": {"val": {"tau": 1.9}}}


def test_a_measurement_outside_the_interval_says_so_and_no_prediction_gives_none() -> None:
    first = _run(STAGES, 2.08, 1.75, [PREDICTED])
    assert bench.grown(first, _run(STAGES, 2.5, 2.0))["out_of_sample"]["inside_interval"] is False
    assert bench.grown(_run(STAGES, 2.08, 1.75), _run(STAGES, 2.5, 2.0))["out_of_sample"] is None


def test_the_first_runs_val_samples_give_the_like_for_like_check() -> None:
    first = _run(STAGES, 2.08, 1.75, [PREDICTED])
    on_first = {"tau": 2.25, "interval": [2.2, 2.3], "num_samples": 126, "missing": []}
    check = bench.grown(first, _run(STAGES, 2.5, 2.0), on_first)["out_of_sample"]
    assert check["inside_interval"] is False  # on the 2x run's own val samples
    assert check["measured_offline_first_val"] == on_first
    assert check["inside_interval_first_val"] is True
    assert (
        "measured_offline_first_val"
        not in bench.grown(first, _run(STAGES, 2.5, 2.0))["out_of_sample"]
    )


BEND_2X = {"data_multiple": 2.0, "tau": 2.34, "interval": [2.25, 2.43], "train_tokens": 1000}


def test_the_bend_is_held_against_the_same_measurements() -> None:
    first = _run(STAGES, 2.08, 1.75, [PREDICTED])
    first["curve"]["bend"] = {"predictions": [BEND_2X]}
    on_first = {"tau": 2.41, "interval": [2.33, 2.49], "num_samples": 115, "missing": []}
    check = bench.grown(first, _run(STAGES, 2.34, 2.0), on_first)["out_of_sample"]
    assert check["inside_interval_first_val"] is False  # the line's: above [2.23, 2.39]
    assert check["bend"] == {
        "predicted": 2.34,
        "interval": [2.25, 2.43],
        "inside_interval": True,
        "inside_interval_first_val": True,
    }
    assert "bend" not in bench.grown(_run(STAGES, 2.08, 1.75, [PREDICTED]), first)["out_of_sample"]


def test_the_first_runs_val_ids_are_kept_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "data/hidden_states").mkdir(parents=True)
    samples = {"b": {"split": "val"}, "a": {"split": "val"}, "c": {"split": "train"}}
    manifest = tmp_path / "data/hidden_states/manifest.json"
    manifest.write_text(json.dumps({"samples": samples}))
    (tmp_path / "params.yaml").write_text("profile: smollm2\n")
    monkeypatch.setattr(bench, "REPO", tmp_path)
    monkeypatch.setattr(bench, "FIRST_VAL_IDS", tmp_path / "ids.json")
    bench.keep_first_val_ids()
    assert json.loads((tmp_path / "ids.json").read_text()) == ["a", "b"]
    # a second 2x run: the store is the 2x run's, the first run's ids stay
    samples["d"] = {"split": "val"}
    manifest.write_text(json.dumps({"samples": samples}))
    (tmp_path / "params.yaml").write_text("profile: smollm2-2x\n")
    bench.keep_first_val_ids()
    assert json.loads((tmp_path / "ids.json").read_text()) == ["a", "b"]


def test_train_tokens_without_curve_points_count_the_training_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The 2x run trains no fractions: its tokens are counted as the curve counts a point's."""
    rows = tmp_path / "data/tokenized/train.jsonl"
    rows.parent.mkdir(parents=True)
    rows.write_text("".join(json.dumps({"input_ids": [1] * n}) + "\n" for n in (3, 5)))
    monkeypatch.setattr(bench, "REPO", tmp_path)
    assert bench._train_tokens([]) == 8
    assert bench._train_tokens([{"fraction": 0.5, "train_tokens": 4}]) == 8
    assert bench._train_tokens([{"fraction": 1.0, "train_tokens": 9}]) == 9


def test_stage_seconds_leave_out_fractions_the_profile_no_longer_lists(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    records = tmp_path / "metrics/provenance"
    records.mkdir(parents=True)
    for stage, s in (("train", 10.04), ("curve_train@0.5", 3.0), ("curve_train@0.25", 2.0)):
        (records / f"{stage}.json").write_text(json.dumps({"duration_s": s}))
    monkeypatch.setattr(bench, "REPO", tmp_path)
    assert bench.stage_seconds([0.5]) == {"curve_train@0.5": 3.0, "train": 10.0}
    assert bench.stage_seconds([]) == {"train": 10.0}


def test_served_block_is_compact_per_set() -> None:
    window = {"tokens": [0, 63], "mean_acceptance_length": 2.5}
    kinds = {k: {"count": 1, "mean_acceptance_length": 2.0} for k in ("looping", "cut", "finished")}
    got_set = {
        "source": "pkg",
        "num_prompts": 2,
        "max_new_tokens": 128,
        "mean_acceptance_length": 2.2,
        "acceptance_per_position": [0.6, 0.4, 0.2],
        "by_answer_position": [window],
        "healthy": {"mean_acceptance_length": 2.1},
        "num_identical": 2,
        "speedup_by_concurrency": {"1": {"speedup": 1.3, "speedup_spread": 0.1}},
        **kinds,
    }
    ev = {
        "served": {
            "num_speculative_tokens": 3,
            "lowest_set": "val",
            "lowest_mean_acceptance_length": 2.2,
            "sets": {"val": got_set},
        }
    }
    got = bench.served(ev)
    assert got is not None and got["lowest_tau"] == 2.2
    val = got["sets"]["val"]
    assert val["by_answer_position"] == {"0-63": 2.5}
    assert val["speedup"] == {"1": {"median": 1.3, "spread": 0.1}}
    assert val["looping"] == {"count": 1, "tau": 2.0} and val["healthy_tau"] == 2.1
    assert bench.served({}) is None
