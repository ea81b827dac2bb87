"""scripts/gpu_check_harness.py: one line per check within a budget; a stage run, its error line."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from scripts_loader import script_module

REPO = Path(__file__).resolve().parents[3]


harness = script_module("gpu_check_harness")


def test_report_prints_one_line_per_check_and_spends_a_budget(capsys) -> None:
    now = [0.0]
    report = harness.Report(10.0, clock=lambda: now[0])
    report.put("PASS", "device", "H200 sm_90")
    now[0] = 4.0
    assert report.left_s() == 6.0 and report.passed
    report.put("SKIP", "mla/extract", "setup failed")
    assert not report.passed
    assert capsys.readouterr().out.splitlines() == [
        "PASS device: H200 sm_90",
        "SKIP mla/extract: setup failed",
    ]


def test_run_stage_refuses_a_spent_budget(tmp_path: Path) -> None:
    with pytest.raises(harness.StageError, match="budget"):
        harness.run_stage(tmp_path, "prepare", 0.0)


def test_tokens_per_s_and_median(tmp_path: Path) -> None:
    assert harness.tokens_per_s(1000, 2.0) == 500.0
    with pytest.raises(ValueError):
        harness.tokens_per_s(10, 0.0)
    tsv = tmp_path / "tokens_per_s.tsv"
    tsv.write_text("step\ttokens_per_s\n0\t10.0\n1\t30.0\n2\t20.0\n")
    assert harness.median_step_tokens_per_s(tsv) == 20.0
    assert harness.median_step_tokens_per_s(tmp_path / "missing.tsv") is None


def test_run_stage_keeps_an_existing_pythonpath_after_the_copy(monkeypatch, tmp_path) -> None:
    """Wheels carried to a bare GPU box (PYTHONPATH) stay importable by every stage."""
    seen = {}

    def fake_run(cmd, cwd, env, **kwargs):
        seen.update(env=env)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(harness.subprocess, "run", fake_run)
    monkeypatch.setenv("PYTHONPATH", "/tmp/site")
    harness.run_stage(tmp_path, "prepare", 10.0)
    assert seen["env"]["PYTHONPATH"] == f"{tmp_path / 'src'}:/tmp/site"
    monkeypatch.delenv("PYTHONPATH")
    harness.run_stage(tmp_path, "prepare", 10.0)
    assert seen["env"]["PYTHONPATH"] == str(tmp_path / "src")


def test_a_failed_stage_names_its_error_line(monkeypatch, tmp_path) -> None:
    """The `error:` line, not the hint or the compiler's context printed after it."""
    out = (
        "[train] epoch 1\nerror: train failed: AssertionError: ListVariable(length=21) is "
        "already tracked\n\nfrom user code:\n  File x.py\n (rerun with --debug for the traceback)\n"
    )
    monkeypatch.setattr(
        harness.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1, "", out)
    )
    with pytest.raises(harness.StageError) as e:
        harness.run_stage(tmp_path, "train", 10.0)
    assert str(e.value) == (
        "train exited 1: error: train failed: AssertionError: ListVariable(length=21) is "
        "already tracked"
    )
    assert (tmp_path / "train.log").read_text() == out
    plain = "just a last line\n"
    monkeypatch.setattr(
        harness.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(cmd, 2, plain, "")
    )
    with pytest.raises(harness.StageError, match="exited 2: just a last line$"):
        harness.run_stage(tmp_path, "train", 10.0)
