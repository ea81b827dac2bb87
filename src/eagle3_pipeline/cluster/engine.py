"""The Ray engine: connect, choose a stage's nodes, run one command on one node.

A worker is a Ray task pinned to one node (hard node affinity) that runs a command of this
project in the repository, on that node's view of the shared filesystem, and returns its exit
status. The command's output reaches the driver's log through Ray (each line prefixed with the
worker's pid and address). Ray never retries a worker by itself: the caller decides where a lost
share reruns (shards.py, torchrun.py). Only the driver imports Ray; `engine: local` never does.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3_pipeline.cluster.local import auth_env, read_state
from eagle3_pipeline.config.training_params import ClusterParams
from eagle3_pipeline.core.errors import PipelineError

# What a worker's command inherits from the driver: the run's settings, never credentials.
PASSED_ENV_PREFIXES = (
    "HF_",
    "VLLM_",
    "OMP_",
    "TOKENIZERS_",
    "TQDM_",
    "DVC_NO_",
    "PYTHONHASHSEED",
    "PYTHONPATH",
    "PATH",
)


@dataclass(frozen=True)
class Node:
    node_id: str
    address: str
    cpus: float = 0.0  # the CPUs the node offers Ray (0: not known)

    @property
    def label(self) -> str:
        """How logs and provenance name a node: its address and the head of its Ray id."""
        return f"{self.address}/{self.node_id[:8]}"


@dataclass
class Outcome:
    """What one worker's command did: its exit status (negative: killed by that signal)."""

    node: Node
    rc: int | None  # None: the worker or its node was lost before the command ended
    error: str = ""
    command_s: float | None = None  # the command's own wall time on the node (the work)
    # Ray says the node itself is gone (its raylet died, or it went before the task could start),
    # even before the GCS lists it dead (seen: NodeDiedError while the node was listed alive).
    node_died: bool = False

    @property
    def lost(self) -> bool:
        """Lost, not failed: the node or the process died under the command (rerun elsewhere)."""
        return self.rc is None or self.rc < 0 or self.rc in (137, 143)


def connect(c: ClusterParams) -> str:
    """Join the Ray cluster at cluster.address (auto: RAY_ADDRESS or the local cluster)."""
    address = c.address
    local = read_state()
    if address == "auto" and not os.environ.get("RAY_ADDRESS") and local is not None:
        address = local["address"]
        os.environ.update(auth_env(Path(local["token_path"])))  # read when Ray is imported
    # Worker lines in the stage's log: plain text, every line (no colour, no deduplication).
    os.environ.setdefault("RAY_COLOR_PREFIX", "0")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    import ray

    if ray.is_initialized():
        return address
    try:
        ray.init(
            address=address,
            namespace="eagle3",
            log_to_driver=True,
            logging_level="ERROR",
            configure_logging=True,
        )
    except (ConnectionError, RuntimeError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise PipelineError(
            f"params.yaml: cluster.address={c.address}: no Ray cluster reachable ({first}): "
            "start one (make cluster-local NODES=2, or `ray start` on each node: "
            "docs/cluster.md)"
        ) from None
    return address


def alive_nodes() -> list[Node]:
    """Alive nodes that can run workers, the driver's own node first, then by Ray id."""
    import ray

    here = ray.get_runtime_context().get_node_id()
    nodes = [
        Node(n["NodeID"], n["NodeManagerAddress"], n["Resources"].get("CPU", 0.0))
        for n in ray.nodes()
        if n["Alive"] and n["Resources"].get("CPU", 0) > 0
    ]
    return sorted(nodes, key=lambda n: (n.node_id != here, n.node_id))


def choose_nodes(
    c: ClusterParams, exclude: set[str] = frozenset(), count: int | None = None
) -> list[Node]:
    """`count` (default cluster.nodes) alive nodes, waiting up to cluster.wait_for_nodes_s."""
    want = count or c.nodes
    key = "nodes" if want == c.nodes else "train_nodes"
    deadline = time.monotonic() + c.wait_for_nodes_s
    while True:
        nodes = [n for n in alive_nodes() if n.node_id not in exclude]
        if len(nodes) >= want:
            return nodes[:want]
        if time.monotonic() >= deadline:
            raise PipelineError(
                f"params.yaml: cluster.{key}={want} but the Ray cluster has "
                f"{len(nodes)} usable alive node(s) after {c.wait_for_nodes_s:.0f} s: add "
                "nodes (make cluster-local NODES=..., or `ray start --address ...`) or lower "
                f"cluster.{key}"
            )
        time.sleep(1.0)


def passed_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith(PASSED_ENV_PREFIXES)}


def driver_environ(env: dict[str, str]) -> dict[str, str]:
    """A worker's environment with `env` (the driver's, passed) over it, as a command the driver
    started itself would get: without the OMP_NUM_THREADS Ray sets to the worker's CPUs (1 by
    default), which would run a shard's extraction or a server on one thread."""
    base = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    return {**base, **env}


def _die_with_parent() -> None:
    """In the command's process: SIGTERM when the Ray worker dies (a cancelled or lost worker)."""
    import ctypes
    import signal

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


SOCKET_IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")  # gloo's, NCCL's: one per run


def interface_of(address: str) -> str | None:
    """This machine's network interface holding `address`; None when none does."""
    import psutil  # vLLM's and Ray's dependency

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address == address for a in addrs):
            return name
    return None


def _run_command(
    argv: list[str], cwd: str, env: dict[str, str], bind_address: str | None = None
) -> dict[str, Any]:
    """Body of a worker: the command in `cwd`, output to the worker's stdout (-> driver).

    `bind_address`: the node's cluster address, which the collectives' sockets must use:
    without GLOO_SOCKET_IFNAME gloo binds whatever the hostname resolves to, often 127.0.0.1
    (as on Debian's 127.0.1.1), and ranks on other nodes then dial their own loopback; NCCL's
    bootstrap and socket transport (NCCL_SOCKET_IFNAME; InfiniBand is chosen apart, by
    NCCL_IB_HCA) otherwise pick the first interface that is not loopback or docker, on a GPU
    node often a management or container interface the other nodes cannot route to. Looked up
    here, on the node; either variable the user set wins."""
    full = driver_environ(env)
    iface = interface_of(bind_address) if bind_address else None
    for name in SOCKET_IFNAME_VARS:
        if iface is not None and name not in full:
            full[name] = iface
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, cwd=cwd, env=full, preexec_fn=_die_with_parent)
    rc = proc.wait()
    return {"rc": rc, "host": socket.gethostname(), "command_s": round(time.monotonic() - t0, 3)}


def submit(
    node: Node,
    argv: list[str],
    c: ClusterParams,
    env: dict[str, str] | None = None,
    bind_collectives: bool = False,
):
    """Start `argv` on `node` as a Ray task; returns its ObjectRef (resolve with `outcome`).
    `bind_collectives`: the command's gloo binds the node's cluster address (torchrun)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    task = ray.remote(_run_command).options(
        num_cpus=c.worker.num_cpus,
        num_gpus=c.worker.num_gpus,
        max_retries=0,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node.node_id, soft=False),
        name=f"eagle3:{' '.join(argv[1:4])}",
    )
    env = {**passed_env(), **(env or {})}
    return task.remote(argv, os.getcwd(), env, node.address if bind_collectives else None)


def outcome(node: Node, ref) -> Outcome:
    """Wait for a worker; a dead worker or node becomes a lost outcome, not an exception."""
    import ray

    try:
        done = ray.get(ref)
        return Outcome(node, done["rc"], command_s=done.get("command_s"))
    except (ray.exceptions.RayError, OSError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        gone = isinstance(exc, ray.exceptions.NodeDiedError | ray.exceptions.TaskUnschedulableError)
        return Outcome(node, None, f"{type(exc).__name__}: {first}", node_died=gone)


def wait_any(refs: list):
    """The first of `refs` to finish (done, failed or lost)."""
    import ray

    ready, _ = ray.wait(list(refs), num_returns=1)
    return ready[0]


def cancel(refs: list) -> None:
    """Kill workers still running (their commands get SIGTERM through the parent-death signal)."""
    import ray

    for ref in refs:
        with contextlib.suppress(ray.exceptions.RayError, ValueError, TypeError):
            ray.cancel(ref, force=True)


def eagle3_argv(*args: str) -> list[str]:
    """The `eagle3` command of this installation (the same path on every node: shared or image):
    the console script beside its interpreter, no module named by hand."""
    return [str(Path(sys.executable).with_name("eagle3")), *args]
