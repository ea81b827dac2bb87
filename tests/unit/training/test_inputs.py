"""training/inputs.py: the run a driver resolves is the run its workers read back; a job counts
its ranks as the launcher starts them."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from builders import train_job, train_params

from eagle3_pipeline.config.training_params import TrainParams
from eagle3_pipeline.drafter.conventions import RunConventions
from eagle3_pipeline.training.inputs import ResolvedRun
from eagle3_pipeline.training.run import TrainSettings

FLAGS = {
    "norm_before_residual": True,
    "norm_before_fc": True,
    "fc_norm": False,
    "norm_output": True,
}


def _settings() -> TrainSettings:
    t = TrainParams.model_validate(
        {"epochs": 2, "nproc": 2, "online": {"endpoint": "http://10.0.0.2:8000/v1"}}
    )
    return TrainSettings.from_params(
        t,
        data_dir=Path("data/.work/train/k-f0.5/data"),
        save_dir=Path("data/.work/train/k-f0.5/checkpoints"),
        verifier_dir=Path("models/verifier"),
        vocab_dir=Path("data/vocab"),
        draft_vocab_size=64,
        conventions=RunConventions([1, 2, 3], 4, dict(FLAGS), {}, {"head_dim": 8}),
        train_data_ratio=0.75,
        nodes=1,
        mask_token_id=7,
        store_positions=[0, 2, 3, 4],
        verifier_num_layers=4,
    )


def test_a_resolved_run_reads_back_as_written(tmp_path: Path) -> None:
    run = ResolvedRun(_settings(), ["a", "b", "c"], Path("data/.work/train/k-f0.5/live"))
    back = ResolvedRun.read(run.write(tmp_path / "run.json"))
    assert back == run
    assert isinstance(back.settings.train, TrainParams) and isinstance(back.settings.data_dir, Path)


def test_a_servers_key_never_reaches_the_file(tmp_path: Path) -> None:
    """Online mode's flags and key are each worker's own (its rank's server, its environment)."""
    settings = dataclasses.replace(
        _settings(), online_flags={"vllm_endpoint": "x"}, online_api_key="secret-key"
    )
    path = ResolvedRun(settings, [], Path("live")).write(tmp_path / "run.json")
    assert "secret-key" not in path.read_text()
    written = json.loads(path.read_text())["settings"]
    assert "online_flags" not in written and "online_api_key" not in written
    back = ResolvedRun.read(path).settings
    assert back.online_flags is None and back.online_api_key is None
    assert back.train.online.endpoint == "http://10.0.0.2:8000/v1"  # the server it trains from


@pytest.mark.parametrize(
    ("nproc", "cluster", "world", "spread"),
    [
        (1, {}, 1, False),
        (2, {}, 2, True),
        (1, {"engine": "ray", "nodes": 3}, 3, True),
        (2, {"engine": "ray", "nodes": 3}, 6, True),
    ],
)
def test_a_job_counts_its_ranks_from_nproc_and_the_clusters_training_nodes(
    nproc: int, cluster: dict, world: int, spread: bool
) -> None:
    job = train_job(train_params(nproc=nproc), cluster)
    assert (job.world_size, job.distributed) == (world, spread)


def test_a_jobs_workers_train_its_rows_with_the_settings_they_are_given() -> None:
    job = train_job(train_params(nproc=2))
    assert job.resolved() == ResolvedRun(job.settings, ["a", "b"], Path("data/.work/train/k/live"))
    served = dataclasses.replace(job.settings, train=job.train.model_copy(update={"epochs": 5}))
    assert job.resolved(served).settings.train.epochs == 5
