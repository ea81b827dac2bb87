"""The end-of-run summary never passes another run's metrics off as this run's."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import yaml

from eagle3_pipeline.config.params import load_params
from eagle3_pipeline.harness import provenance
from eagle3_pipeline.report import summary

REPO = Path(__file__).resolve().parents[3]
COUNTS = {
    "mean_acceptance_length": 2.5,
    "acceptance_rate": 0.5,
    "acceptance_per_position": [0.7, 0.5, 0.3],
}
EVAL = {
    "num_speculative_tokens": 3,
    "offline": {"trained": COUNTS, "untrained": COUNTS | {"mean_acceptance_length": 1.0}},
}


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    (tmp_path / "params.yaml").write_text((REPO / "params.yaml").read_text())
    (tmp_path / "metrics/provenance").mkdir(parents=True)
    (tmp_path / "metrics/eval.json").write_text(json.dumps(EVAL))
    cwd = Path.cwd()
    os.chdir(tmp_path)
    record = provenance.collect("evaluate", load_params("params.yaml"))
    Path("metrics/provenance/evaluate.json").write_text(json.dumps(record))
    yield tmp_path
    os.chdir(cwd)


def test_matching_params(run_dir: Path, capsys) -> None:
    assert summary.main() == 0
    out = capsys.readouterr()
    assert "offline simulated mean acceptance length: 2.500" in out.out and out.err == ""


def test_served_figures_lead_the_summary(run_dir: Path, capsys) -> None:
    """Served acceptance per held-out set, with each trusted speed-up, comes first."""
    timed = {"speedup": 1.31, "speedup_spread": 0.1}
    served = {
        "num_speculative_tokens": 3,
        "lowest_set": "humaneval",
        "lowest_mean_acceptance_length": 1.5,
        "sets": {
            "val": {"mean_acceptance_length": 2.0, "speedup_by_concurrency": {"1": timed}},
            "humaneval": {
                "mean_acceptance_length": 1.5,
                "speedup_by_concurrency": {"1": {"speedup": None}, "8": timed},
            },
        },
    }
    (run_dir / "metrics/eval.json").write_text(json.dumps({"served": served} | EVAL))
    assert summary.main() == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == (
        "served (vLLM's counts, 3 drafts) on held-out prompts: val 2.000 (x1.31@1); "
        "humaneval 1.500 (x1.31@8); lowest: humaneval 1.500"
    )


def test_three_drafters_side_by_side(run_dir: Path, capsys) -> None:
    """With train.init_from, the init checkpoint as published is printed beside the others."""
    with_init = EVAL | {
        "offline": EVAL["offline"] | {"init": COUNTS | {"mean_acceptance_length": 2.125}}
    }
    (run_dir / "metrics/eval.json").write_text(json.dumps(with_init))
    assert summary.main() == 0
    out = capsys.readouterr().out
    assert (
        "2.500 of 4 (untrained drafter: 1.000, init checkpoint without fine-tuning: 2.125)" in out
    )


def test_no_init_entry_without_init_from(run_dir: Path, capsys) -> None:
    assert summary.main() == 0
    assert "init checkpoint" not in capsys.readouterr().out


def test_params_changed_since_the_measurement(run_dir: Path, capsys) -> None:
    params = yaml.safe_load(Path("params.yaml").read_text())
    params["train"]["epochs"] += 1
    Path("params.yaml").write_text(yaml.safe_dump(params))
    assert summary.main() == 1
    err = capsys.readouterr().err
    assert "NOT the numbers of the current params" in err and "metrics/eval.json" in err


def test_a_comment_is_not_a_change(run_dir: Path, capsys) -> None:
    Path("params.yaml").write_text("# edited\n" + Path("params.yaml").read_text())
    assert summary.main() == 0


def test_no_record(run_dir: Path, capsys) -> None:
    Path("metrics/provenance/evaluate.json").unlink()
    assert summary.main() == 1
    assert "nothing says which params" in capsys.readouterr().err


ROUNDS = {
    "mean_acceptance_length": 2.75,
    "acceptance_rate": 0.583,
    "tokens_per_s": 299.5,
    "tokens_per_s_baseline": 220.0,
    "speedup": 1.36,
    "speedup_rounds": [1.31, 1.36, 1.4, 1.34, 1.38],
    "speedup_spread": 0.066,
    "speedup_trusted": True,
}


def test_the_speedup_is_the_median_of_paired_rounds(run_dir: Path, capsys) -> None:
    (run_dir / "metrics/eval.json").write_text(json.dumps(EVAL | {"online": ROUNDS}))
    assert summary.main() == 0
    assert (
        "acceptance rate 58.3%, 299.5 tokens/s with the drafter vs 220.0 without (x1.36, median "
        "of 5 paired rounds, spread 0.07); greedy outputs identical" in capsys.readouterr().out
    )


def test_a_wide_spread_is_said_instead_of_a_figure(run_dir: Path, capsys) -> None:
    note = (
        "no figure: the 5 paired rounds' ratios range from x1.28 to x10.83, a spread of 7.07 "
        "above evaluate.speedup_max_spread=0.25: the machine's speed changed during the rounds "
        "(other work on it?), rerun evaluate on a quiet machine"
    )
    wide = ROUNDS | {
        "speedup": None,
        "speedup_trusted": False,
        "speedup_spread": 7.07,
        "speedup_note": note,
    }
    (run_dir / "metrics/eval.json").write_text(json.dumps(EVAL | {"online": wide}))
    assert summary.main() == 0
    out = capsys.readouterr().out
    assert "x1.36" not in out
    assert (
        "299.5 tokens/s with the drafter vs 220.0 without in the median round, no speed-up "
        "figure: the 5 paired rounds' ratios range from x1.28 to x10.83, a spread of 7.07" in out
    )


def _measured_with(families: dict, train_family: dict | None = None) -> None:
    """params.yaml with these `families` (and train.family), recorded as evaluate's params."""
    params = yaml.safe_load(Path("params.yaml").read_text())
    params["families"] = families
    if train_family is not None:
        params["train"]["family"] = train_family
    Path("params.yaml").write_text(yaml.safe_dump(params))
    record = provenance.collect("evaluate", load_params("params.yaml"))
    Path("metrics/provenance/evaluate.json").write_text(json.dumps(record))


def test_no_comparison_without_families(run_dir: Path, capsys) -> None:
    assert summary.main() == 0
    assert "drafters at" not in capsys.readouterr().out


def test_families_end_with_one_table(run_dir: Path, capsys) -> None:
    """Each branch in params that was evaluated gets a row under train's drafter, with its
    served figures, its best draft count and what it learned over its untrained twin."""
    families = {"e31": {"name": "eagle3.1"}, "pe": {"name": "peagle"}}
    _measured_with(families, {"name": "eagle3.1"})  # train's row names train's family
    online = {
        "mean_acceptance_length": 2.75,
        "tokens_per_s": 300.0,
        "tokens_per_s_baseline": 200.0,
        "speedup": 1.5,
        "best_num_speculative_tokens": 2,
        "by_num_speculative_tokens": {"2": {"speedup": 1.625}},
    }
    branch = Path("metrics/families/e31")
    branch.mkdir(parents=True)
    (branch / "eval.json").write_text(
        json.dumps(
            {
                "family": "eagle3.1",
                "drafting": "chained",
                "offline": {"trained": COUNTS},
                "online": online,
                "lossless": {"verdict": "identical"},
            }
        )
    )
    twin = {"val_accuracy_by_position": {"1": 0.002}}
    drafter = {"val_accuracy_by_position": {"1": 0.75}, "untrained_twin": twin}
    (branch / "train.json").write_text(json.dumps({"drafter": drafter}))
    assert summary.main() == 0
    lines = capsys.readouterr().out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("drafters at 3 draft tokens"))
    head, *body = lines[at + 1 :]
    assert head.split()[:3] == ["drafter", "family", "drafting"]
    assert body[0].split()[:5] == ["train", "eagle3.1", "chained", "2.500", "-"]
    assert "1.000 -> 2.500 offline" in body[0]
    assert body[1].split() == [
        "e31", "eagle3.1", "chained", "2.500", "2.750", "300.0/200.0", "x1.50", "2:", "x1.62",
        "identical", "0.002", "->", "0.750", "val", "acc@1",
    ]  # fmt: skip
    assert len(body) == 2  # pe has not been evaluated: no row


def test_the_table_says_which_speedups_have_no_figure(run_dir: Path, capsys) -> None:
    """A branch whose paired rounds spread too wide: "none (spread S)" where its speedup
    would be, and at its best count "none" when no swept count has a figure."""
    _measured_with({"pe": {"name": "peagle"}})
    wide = {"speedup": None, "speedup_trusted": False, "speedup_spread": 0.48}
    online = ROUNDS | wide
    online |= {"by_num_speculative_tokens": {"2": wide, "3": wide}}
    online |= {"best_num_speculative_tokens": None}
    branch = Path("metrics/families/pe")
    branch.mkdir(parents=True)
    doc = {"family": "peagle", "drafting": "parallel", "offline": {"trained": COUNTS}}
    (branch / "eval.json").write_text(json.dumps(doc | {"online": online}))
    assert summary.main() == 0
    lines = capsys.readouterr().out.splitlines()
    (row,) = [line for line in lines if line.startswith("pe ")]
    cells = re.split(r"\s{2,}", row)  # columns are two spaces apart at least
    assert cells[5:9] == ["299.5/220.0", "none (spread 0.48)", "none", "-"]


def test_a_broken_branch_file_is_one_line_and_exit_1(run_dir: Path, capsys) -> None:
    _measured_with({"e31": {"name": "eagle3.1"}})
    Path("metrics/families/e31").mkdir(parents=True)
    Path("metrics/families/e31/eval.json").write_text("{not json")
    assert summary.main() == 1
    err = capsys.readouterr().err.strip()
    assert err == (
        "error: metrics/families/e31/eval.json: not valid JSON (line 1): rerun the stage: "
        "dvc repro --force --single-item family_eval@e31"
    )


def test_the_learning_curve_ends_the_summary(run_dir: Path, capsys) -> None:
    """With a curve (the curve stage's metrics/curve.json): its points, check and predictions."""
    point = {"train_samples": 100, "train_tokens": 20_000, "tau_interval": [1.4, 1.6]}
    curve = {
        "confidence": 0.9,
        "points": [point | {"fraction": 0.5, "tau": 1.5}, point | {"fraction": 1.0, "tau": 1.7}],
        "check": None,
        "predictions": [
            {"data_multiple": 2.0, "train_tokens": 40_000, "tau": 1.9, "interval": [1.8, 2.0]}
        ],
        "epochs": {"tau_by_epoch": [1.2, 1.7], "peak_epoch": 1},
    }
    (run_dir / "metrics/curve.json").write_text(json.dumps(curve))
    assert summary.main() == 0
    out = capsys.readouterr().out
    assert "learning curve (metrics/curve.json" in out
    assert "2x the data (40,000 tokens): predicted 1.900 [1.800, 2.000]" in out
    assert "val acceptance by epoch: 1.200, 1.700 (peak at epoch 2 of 2)" in out
