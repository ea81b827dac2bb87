"""Multi-process training: torchrun on one node, signals forwarded, no orphans left behind."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
from typing import Any

from eagle3_pipeline.training.run import TrainingInterrupted


def torchrun_command(nproc: int, module: str, args: list[str]) -> list[str]:
    """`python -m torch.distributed.run` (= torchrun) on one node, rendezvous on localhost."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        module,
        *args,
    ]


def launch_torchrun(cmd: list[str]) -> None:
    """Run `cmd` (a torchrun command); SIGINT/SIGTERM reach the workers; failures raise.

    Raises TrainingInterrupted when a signal stopped it (rerunning resumes), RuntimeError on
    any other non-zero exit.
    """
    proc = subprocess.Popen(cmd, preexec_fn=_die_with_parent)
    signalled: list[int] = []

    def forward(signum: int, _frame: Any) -> None:
        signalled.append(signum)
        proc.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        rc = proc.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if signalled or rc in (-signal.SIGINT, -signal.SIGTERM, 130):
        raise TrainingInterrupted(
            f"training stopped by a signal (torchrun exit {rc}); rerun to resume from the "
            "last complete epoch"
        )
    if rc != 0:
        raise RuntimeError(f"torchrun exited with {rc}: see the workers' output above")


def _die_with_parent() -> None:
    """In the torchrun child: SIGTERM when this process dies, SIGKILL included (Linux).

    torchrun forwards it to the workers, so no orphan keeps training beside a rerun.
    """
    import ctypes

    with contextlib.suppress(OSError, AttributeError):  # not glibc: no parent-death signal
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
