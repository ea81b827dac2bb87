"""One writer per stage output, and the temp files of a killed run swept at the next start.

`hold(stage)` takes an exclusive flock on data/.work/locks/<stage>.lock for the stage's lifetime
(the CLI holds it around `run`); a second `eagle3 <stage>` (by hand, or under DVC) is refused
with one line naming the holder. A flock dies with its process, SIGKILL included, so a killed
run never leaves a stale lock; children (vLLM, torchrun) do not inherit it (Python's fds are not
inheritable). Shards of extract lock per shard: they write disjoint batches by design.

Holding the lock, `sweep` removes what a killed run of THIS stage left: temp names beside its
outputs (`data/.verifier.<random>.tmp`, `.<name>.old-<pid>`), beside its provenance record, and
hidden `.tmp` files in its scratch folder. Extract's scratch is shared by shards running on
other nodes: extract sweeps there itself, only the samples it is about to write.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shlex
import shutil
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from eagle3_pipeline.core import atomic, paths
from eagle3_pipeline.core.errors import PipelineError

LOCKS = paths.SCRATCH / "locks"

# Each stage's DVC outputs (dvc.yaml `outs` and `metrics`; tests/unit/harness/test_stage_lock.py
# checks).
STAGE_OUTPUTS: dict[str, tuple[Path, ...]] = {
    "check": (paths.CHECKED,),
    "verifier": (paths.VERIFIER,),
    "synthesize": (paths.SYNTHESIZED,),
    "prepare": (paths.PREPARED,),
    "generate": (paths.GENERATED,),
    "tokenize": (paths.TOKENIZED,),
    "extract": (paths.HIDDEN_STATES,),
    "vocab": (paths.VOCAB, paths.VOCAB_METRICS),
    "train": (paths.TRAINED, paths.TRAIN_LIVE, paths.TRAIN_METRICS),
    "export": (paths.DRAFTER,),
    "evaluate": (paths.EVAL_METRICS,),
    "curve": (paths.CURVE, paths.CURVE_TOKENS, paths.CURVE_EPOCHS),
}
_SHARED_SCRATCH = {"extract"}


def outputs_of(stage: str) -> tuple[Path, ...]:
    """The stage's DVC outputs, those of a `families` branch (family@NAME, family_eval@NAME)
    and of a learning-curve fraction (curve_train@F) included."""
    kind, _, name = stage.partition("@")
    metrics = paths.FAMILIES_METRICS / name
    if kind == "family":
        return (paths.FAMILIES_MODELS / name, metrics / "train", metrics / "train.json")
    if kind == "family_eval":
        return (metrics / "eval.json",)
    if kind == "curve_train":
        fraction = paths.CURVE_FRACTIONS / name
        return (
            paths.CURVE_MODELS / name,
            fraction / "train",
            fraction / "train.json",
            fraction / "eval.json",
        )
    return STAGE_OUTPUTS.get(stage, ())


class StageBusyError(PipelineError):
    """The same stage is already running and writing the same outputs."""


def lock_path(stage: str, shard: tuple[int, int] | None = None) -> Path:
    name = stage if shard is None else f"{stage}.shard-{shard[0]}-of-{shard[1]}"
    return LOCKS / f"{name}.lock"


def _holder(fd: int) -> str:
    """`pid 123 on host, since 2025-01-01 12:00:00, command ...` from the lock file."""
    try:
        info = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except (OSError, json.JSONDecodeError):
        info = {}
    if not info:
        return "another process (no details recorded)"
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info.get("since", 0)))
    return f"pid {info.get('pid')} on {info.get('host')}, since {since}: `{info.get('command')}`"


@contextlib.contextmanager
def hold(stage: str, shard: tuple[int, int] | None = None) -> Iterator[None]:
    """Exclusive for the block's duration, or StageBusyError naming the holder."""
    path = lock_path(stage, shard)
    path.parent.mkdir(parents=True, exist_ok=True)
    ignore = path.parent / ".gitignore"  # never a change to commit, whatever the repo ignores
    if not ignore.exists():
        atomic.write_text(ignore, "*\n")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise StageBusyError(
                f"{stage} is already running ({_holder(fd)}; lock {path}): wait for it to end "
                "or stop it; two runs would write the same outputs"
            ) from None
        record = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "since": time.time(),
            "command": shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock


def sweep(stage: str) -> list[Path]:
    """Remove the temp files a killed run of `stage` left; call while holding its lock."""
    removed: list[Path] = []
    for out in (*outputs_of(stage), paths.PROVENANCE / f"{stage}.json"):
        removed += atomic.sweep_temps(out)
    scratch = paths.SCRATCH / stage
    if stage not in _SHARED_SCRATCH and scratch.is_dir():
        for tmp in sorted(scratch.rglob(".*.tmp")):
            if tmp.is_dir() and not tmp.is_symlink():
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                tmp.unlink(missing_ok=True)
            removed.append(tmp)
    return removed


def clean_scratch() -> list[Path]:
    """Empty data/.work/ (resume state, vLLM caches) unless a stage is running: every existing
    lock is taken first, so a running stage's scratch is never deleted under it."""
    held: list[int] = []
    busy: list[str] = []
    try:
        for path in sorted(LOCKS.glob("*.lock")) if LOCKS.is_dir() else []:
            fd = os.open(path, os.O_RDWR)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                busy.append(f"{path.stem} ({_holder(fd)})")
                os.close(fd)
                continue
            held.append(fd)
        if busy:
            raise StageBusyError(
                f"{paths.SCRATCH} is in use by {len(busy)} running stage(s): {'; '.join(busy)}: "
                "wait for them to end or stop them, then clean"
            )
        removed = []
        for entry in sorted(paths.SCRATCH.iterdir()) if paths.SCRATCH.is_dir() else []:
            if entry == LOCKS:
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
            removed.append(entry)
        return removed
    finally:
        for fd in held:
            os.close(fd)
