"""The end-of-run summary never passes another run's metrics off as this run's."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from eagle3_pipeline import provenance
from eagle3_pipeline.params import load_params
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
