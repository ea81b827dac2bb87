"""torchrun command and launcher: exit codes become the right exceptions."""

from __future__ import annotations

import sys

import pytest

from eagle3_pipeline.training import launch
from eagle3_pipeline.training.run import TrainingInterrupted


def test_torchrun_command() -> None:
    cmd = launch.torchrun_command(2, "eagle3_pipeline.stages.train", ["--worker", "p.json"])
    assert cmd[1:] == [
        "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
        "-m", "eagle3_pipeline.stages.train", "--worker", "p.json",
    ]  # fmt: skip


def test_launch_raises_on_failure_and_signal() -> None:
    launch.launch_torchrun([sys.executable, "-c", "pass"])
    with pytest.raises(RuntimeError, match="exited with 3"):
        launch.launch_torchrun([sys.executable, "-c", "raise SystemExit(3)"])
    with pytest.raises(TrainingInterrupted):
        launch.launch_torchrun([sys.executable, "-c", "raise SystemExit(130)"])
