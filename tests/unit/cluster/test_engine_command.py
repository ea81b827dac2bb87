"""The body of a cluster worker (engine._run_command), run here without Ray: the command gets the
driver's environment, not the OMP_NUM_THREADS Ray sets in a worker."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from eagle3_pipeline.cluster import engine


def _run(tmp_path: Path, passed: dict[str, str]) -> str:
    out = tmp_path / "out.txt"
    code = (
        "import os; e = os.environ.get; "
        f"print(e('OMP_NUM_THREADS'), e('HF_X'), file=open({str(out)!r}, 'w'))"
    )
    argv = [sys.executable, "-c", code]
    result = engine._run_command(argv, str(tmp_path), passed)
    assert result["rc"] == 0
    return out.read_text().strip()


def test_ray_s_omp_num_threads_does_not_reach_the_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # what Ray sets in a 1-CPU worker
    assert _run(tmp_path, {"HF_X": "y"}) == "None y"


def test_the_driver_s_own_omp_num_threads_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert _run(tmp_path, {"OMP_NUM_THREADS": "3"}) == "3 None"
