"""stages/train.py's torchrun workers train the run the driver resolved, a learning-curve
fraction included: the same rows and the scratch folder the driver publishes from (a worker that
trained every row elsewhere would leave the fraction's checkpoints empty), never rebuilt from
params; 1 process and 2 train the same rows, the fraction's, as their loaders recorded them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from train_workspace import build_workspace

from eagle3_pipeline.config.params import load_params
from eagle3_pipeline.conversations import split
from eagle3_pipeline.stages import train
from eagle3_pipeline.training import launch as launch_module
from eagle3_pipeline.training.data import ids_hash
from eagle3_pipeline.training.inputs import TrainJob


@pytest.fixture
def workspace(tmp_path: Path, tiny_verifier_dir: Path, monkeypatch) -> Path:
    build_workspace(tmp_path, tiny_verifier_dir, n_train=40, n_val=4)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_each_worker_trains_the_drivers_fraction(workspace: Path, monkeypatch) -> None:
    params = load_params(workspace / "params.yaml").model_copy(deep=True)
    params.train.nproc = 2
    params.curve.fractions = [0.5]
    driver = train._inputs(params, "train.family", 0.5)
    every_row = train._inputs(params)
    assert driver.n_train < every_row.n_train  # the fraction is a part: the test can tell
    commands: list[list[str]] = []
    monkeypatch.setattr(launch_module, "launch_torchrun", commands.append)
    job = TrainJob(train.run_settings(params, driver), driver, params.cluster, params.vllm)
    run = job.resolved()
    launch_module.launch(params.cluster, run, driver, train.__name__)
    argv = commands[0][commands[0].index(train.__name__) + 1 :]
    assert argv == ["--worker", str((driver.work / launch_module.RUN_FILE).resolve())]

    def rebuilt(*_args, **_kwargs):
        raise AssertionError("a worker rebuilt the run from params")

    seen: list = []
    monkeypatch.setattr(train, "die_with_agent", lambda: None)
    monkeypatch.setattr(train, "_inputs", rebuilt)
    monkeypatch.setattr(train, "_train_resolved", lambda run, source=None: seen.append(run))
    assert train._worker_main(argv) == 0
    worker = seen[0]
    assert worker.settings == train.run_settings(params, driver)
    assert (worker.settings.data_dir, worker.row_ids) == (driver.data_dir, driver.row_ids)
    assert worker.live_dir == driver.live_dir


def test_a_worker_with_a_bad_command_line_says_how_to_call_it(capsys) -> None:
    assert train._worker_main(["--worker"]) == 2
    assert "usage: python -m eagle3_pipeline.stages.train --worker" in capsys.readouterr().err


@pytest.mark.slow
def test_one_process_and_two_train_the_fractions_rows(
    tmp_path: Path, tiny_verifier_dir: Path, monkeypatch
) -> None:
    """What each run's loaders held (the metrics file's train_rows, train_ids_hash): the same
    rows with nproc 1 and 2, and exactly those split.in_fraction selects, fewer than all."""
    build_workspace(tmp_path, tiny_verifier_dir, n_train=8, n_val=2, train={"epochs": 1})
    monkeypatch.chdir(tmp_path)
    params = load_params(tmp_path / "params.yaml").model_copy(deep=True)
    params.curve.fractions = [0.5]
    recorded = []
    for nproc in (1, 2):
        params.train.nproc = nproc
        train.run_fraction(params, 0.5)
        recorded.append(json.loads(Path("metrics/fractions/0.5/train.json").read_text()))
    tokenized = Path("data/tokenized/train.jsonl").read_text().splitlines()
    rows = [json.loads(line)["id"] for line in tokenized]
    inside = [i for i in rows if split.in_fraction(i, 0.5, params.prepare.val_ratio)]
    assert 0 < len(inside) < len(rows)  # a part: the test can tell it from every row
    expected = {"train_rows": len(inside), "train_ids_hash": ids_hash(inside)}
    for record in recorded:
        assert {k: record[k] for k in expected} == expected
