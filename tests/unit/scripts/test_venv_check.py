"""`make venv` refuses a set-up the CPU lock cannot give, in one line naming the fix."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "scripts"))
import venv_check  # noqa: E402

LOCK = (REPO / "locks/cpu.txt").read_text()


def test_the_lock_admits_exactly_cpython_311_on_x86_64_manylinux_2_28() -> None:
    """The header's target is what torch's only wheel (the one hash of its entry) is built for."""
    assert venv_check.lock_target(LOCK) == ("3.11", "x86_64", "2.28")
    version, requirement = venv_check.torch_entry(LOCK)
    assert version == "2.13.0+cpu" and requirement.count("--hash=") == 1


def test_a_wrong_interpreter_is_named_with_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(venv_check.platform, "machine", lambda: "arm64")
    monkeypatch.setattr(venv_check.platform, "system", lambda: "Darwin")
    monkeypatch.setattr(venv_check.platform, "libc_ver", lambda: ("", ""))
    problem = venv_check.interpreter_problem("3.11", "x86_64", "2.28")
    assert problem is not None and "\n" not in problem
    assert "on Darwin arm64 (no glibc)" in problem and "PYTHON=python3.11" in problem


def test_an_old_glibc_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(venv_check.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(venv_check.platform, "system", lambda: "Linux")
    monkeypatch.setattr(venv_check.platform, "libc_ver", lambda: ("glibc", "2.17"))
    have = f"{sys.version_info[0]}.{sys.version_info[1]}"
    assert "glibc 2.17" in (venv_check.interpreter_problem(have, "x86_64", "2.28") or "")
    monkeypatch.setattr(venv_check.platform, "libc_ver", lambda: ("glibc", "2.36"))
    assert venv_check.interpreter_problem(have, "x86_64", "2.28") is None


def test_torch_needs_a_folder_with_its_wheel_or_an_index(tmp_path: Path) -> None:
    none = venv_check.torch_problem("2.13.0+cpu", "", "")
    assert none == (
        "torch 2.13.0+cpu is not on PyPI: pass FIND_LINKS=<folder with the wheel> or "
        "TORCH_INDEX=https://download.pytorch.org/whl/cpu"
    )
    assert "no torch-2.13.0+cpu-*.whl in FIND_LINKS=" in (
        venv_check.torch_problem("2.13.0+cpu", str(tmp_path), "") or ""
    )
    (tmp_path / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl").touch()
    assert venv_check.torch_problem("2.13.0+cpu", str(tmp_path), "") is None
    assert (
        venv_check.torch_problem("2.13.0+cpu", "", "https://download.pytorch.org/whl/cpu") is None
    )


def test_make_venv_stops_at_once_naming_what_to_add(tmp_path: Path) -> None:
    """No pip configuration, no FIND_LINKS: one make line, nothing created."""
    venv = tmp_path / "venv"
    proc = subprocess.run(
        ["make", "--no-print-directory", "venv", f"VENV={venv}", "FIND_LINKS="],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", "PIP_CONFIG_FILE": "/dev/null", "HOME": str(tmp_path)},
        timeout=60,
    )
    assert proc.returncode != 0 and not venv.exists()
    assert proc.stdout == ""
    assert re.fullmatch(
        r"Makefile:\d+: \*\*\* torch 2\.13\.0\+cpu is not on PyPI: .*Stop\.\n", proc.stderr
    )
