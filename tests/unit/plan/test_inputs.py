"""inputs: a missing config file is one line naming the file and the fix."""

from __future__ import annotations

from pathlib import Path

from plan_cases import PROFILE, refused

from eagle3_pipeline.core.errors import CheckpointError


def test_init_config_missing(tmp_path: Path, capsys) -> None:
    missing = tmp_path / "AQ-MedAI-Kimi-K25-eagle3"
    refused(capsys, PROFILE, CheckpointError, "config.json: not found", init=missing)
