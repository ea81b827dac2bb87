"""Multi-process training: torchrun on one node, or one torchrun agent per node of a Ray cluster;
signals forwarded, no orphans left behind.

`launch` writes the driver's resolved run (training/inputs.ResolvedRun) to its scratch folder
and starts `python -m MODULE --worker RUN_JSON` per process (MODULE: the stage's, whose worker
entry trains that run as it is). With `cluster.engine: ray` the workers run under one torchrun
agent per training node (cluster/torchrun.py: c10d rendezvous; a lost node relaunches from the
last complete epoch), on the training pool when online training has one
(online_training/pools.py), and which node did what goes into the stage's provenance.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from typing import Any, Protocol

from eagle3_pipeline.config.training_params import ClusterParams
from eagle3_pipeline.core.progress import log
from eagle3_pipeline.training.checkpoints import discard_incomplete, resume_epoch
from eagle3_pipeline.training.inputs import ResolvedRun, TrainInputs, nodes
from eagle3_pipeline.training.metrics import trim_live
from eagle3_pipeline.training.run import TrainingInterrupted


class ServerPools(Protocol):
    """What a launch across nodes needs of online training's server pools
    (online_training/pools.py): which nodes serve, each trainer's environment, lost servers."""

    inference: list[Any]

    def trainer_env(self, node: Any) -> dict[str, str]: ...

    def newly_lost(self) -> list[str]: ...

    def served(self) -> dict[str, Any]: ...


STAGE = "train"
RUN_FILE = "run.json"  # the resolved run, in the run's scratch folder


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


def launch(
    c: ClusterParams,
    run: ResolvedRun,
    inputs: TrainInputs,
    module: str,
    pools: ServerPools | None = None,
) -> None:
    """One worker (`python -m MODULE --worker RUN_JSON`) per process under torchrun (on the
    nodes of cluster `c` with engine ray), each training `run` (written to the run's scratch
    folder) as the driver resolved it: its rows (a learning-curve fraction's), its scratch
    folder, its server."""
    spec = run.write(inputs.work / RUN_FILE)
    worker = ["--worker", str(spec.resolve())]
    t = run.settings.train
    if c.engine == "ray":
        _launch_on_cluster(c, run, inputs, module, worker, pools)
        return
    cmd = torchrun_command(t.nproc, module, worker)
    log(STAGE, f"launching {t.nproc} processes ({t.strategy}): torchrun")
    launch_torchrun(cmd)


def _launch_on_cluster(
    c: ClusterParams,
    run: ResolvedRun,
    inputs: TrainInputs,
    module: str,
    worker: list[str],
    pools: ServerPools | None,
) -> None:
    """One torchrun agent per training node (cluster.torchrun), on the training pool when
    online training has one; record who did what."""
    from eagle3_pipeline.cluster import engine, preflight, record, torchrun

    t = run.settings.train
    engine.connect(c)

    def before_attempt(number: int) -> None:
        if number == 1:  # the stage tidied the scratch dir already
            return
        removed = discard_incomplete(inputs.save_dir)
        trim_live(inputs.live_dir, inputs.save_dir)
        done = resume_epoch(inputs.save_dir)
        log(
            STAGE,
            f"cluster: attempt {number} "
            + (f"resumes after epoch {done}" if done is not None else "starts afresh")
            + (f" (discarded incomplete: {', '.join(removed)})" if removed else ""),
        )

    log(
        STAGE,
        f"launching {nodes(c)} nodes x {t.nproc} processes ({t.strategy}): torchrun through Ray",
    )
    rec = torchrun.run_across_nodes(
        c,
        t.nproc,
        module,
        worker,
        before_attempt=before_attempt,
        check_nodes=lambda found: preflight.check(found, c, str(run.settings.verifier_dir)),
        exclude=frozenset(n.node_id for n in pools.inference) if pools else frozenset(),
        env_for=pools.trainer_env if pools else lambda node: {},
        servers_lost=pools.newly_lost if pools else lambda: [],
    )
    if pools:
        rec["online"] = pools.served()
    record.write(inputs.record_as, rec)


def die_with_agent() -> None:
    """SIGKILL this worker when its torchrun agent dies (a lost node's agent, SIGKILL included):
    a worker orphaned by its agent must not write beside the relaunched run."""
    import ctypes

    parent = os.getppid()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the agent died before the signal was armed
        os._exit(1)
