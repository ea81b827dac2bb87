"""Train across nodes: one torchrun agent per training node, launched through the engine.

Each agent is `python -m torch.distributed.run --nnodes N --nproc-per-node G --rdzv-backend c10d`
with the rendezvous store on the first node (`is_host=1` there, 0 elsewhere) at
cluster.rdzv_port and a fresh run id per attempt; torchrun gives every process its global RANK
(speculators shards samples by it) and rank 0 alone writes checkpoints. The workers run the same
`python -m eagle3_pipeline.stages.train --worker SPEC` as on one node.

A node lost mid-train (its agent or its Ray node died) ends the attempt: the other agents stop
by themselves (their collectives break) or are cancelled after SETTLE_S, the caller's
`before_attempt` discards the incomplete epoch, and the agents start again on alive nodes,
resuming from the last complete epoch (training.checkpoints), up to cluster.max_attempts. A
failure that is not a loss (an agent exits > 0 while none was lost) raises at once.
"""

from __future__ import annotations

import os
import secrets
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from eagle3_pipeline.cluster import engine
from eagle3_pipeline.config.training_params import ClusterParams
from eagle3_pipeline.core.errors import PipelineError
from eagle3_pipeline.core.progress import log

STAGE = "train"
# After one agent ended badly, how long the others get to end by themselves (a broken collective
# ends them in seconds) and Ray to report a dead node (measured: a killed local node's task
# failed with NodeDiedError well within this) before they are cancelled.
SETTLE_S = 60.0


def agent_command(
    *,
    nnodes: int,
    nproc: int,
    endpoint: str,
    run_id: str,
    is_host: bool,
    local_addr: str,
    module: str,
    args: list[str],
) -> list[str]:
    """One node's torchrun agent (launch.torchrun_command's shape, c10d instead of standalone)."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={nnodes}",
        f"--nproc-per-node={nproc}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={endpoint}",
        f"--rdzv-id={run_id}",
        f"--rdzv-conf=is_host={int(is_host)}",
        f"--local-addr={local_addr}",
        "--max-restarts=0",
        "-m",
        module,
        *args,
    ]


def _wait(refs: list, timeout_s: float | None) -> list:
    """The refs among `refs` that finished within timeout_s (None: at least one)."""
    import ray

    ready, _ = ray.wait(list(refs), num_returns=1, timeout=timeout_s)
    return ready


@dataclass
class _Attempt:
    nodes: list[engine.Node]
    outcomes: dict[str, engine.Outcome] = field(default_factory=dict)  # node id -> outcome
    cancelled: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return len(self.outcomes) == len(self.nodes) and all(
            o.rc == 0 for o in self.outcomes.values()
        )

    @property
    def lost(self) -> list[engine.Outcome]:
        return [o for o in self.outcomes.values() if o.lost and o.node.label not in self.cancelled]


def rank_threads(node: engine.Node, nproc: int) -> dict[str, str]:
    """OMP_NUM_THREADS for each of a node's `nproc` ranks: the node's CPUs (as Ray counts them)
    shared among them, unless the driver's environment sets it. torchrun sets 1 only for
    nproc > 1; one rank per node would otherwise take every core of a machine that several
    local nodes share, and on a real node a fixed 1 would starve the data loading."""
    if "OMP_NUM_THREADS" in os.environ or node.cpus <= 0:
        return {}
    return {"OMP_NUM_THREADS": str(max(1, int(node.cpus) // nproc))}


def _run_attempt(
    nodes: list[engine.Node],
    argv_for: Callable[[int, engine.Node], list[str]],
    c: ClusterParams,
    env_for: Callable[[engine.Node], dict[str, str]] = lambda node: {},
    nproc: int = 1,
) -> _Attempt:
    """Start one agent per node; wait until all ended, or one ended badly and the rest settled."""
    attempt = _Attempt(nodes)
    running = {}
    for i, n in enumerate(nodes):
        env = {**rank_threads(n, nproc), **env_for(n)}
        running[engine.submit(n, argv_for(i, n), c, env or None, bind_collectives=True)] = n
    deadline: float | None = None
    try:
        while running:
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = _wait(list(running), timeout)
            if not ready:  # the settle window passed: stop the agents still running
                for node in running.values():
                    attempt.cancelled.append(node.label)
                break
            for ref in ready:
                node = running.pop(ref)
                out = engine.outcome(node, ref)
                attempt.outcomes[node.node_id] = out
                if out.rc != 0 and deadline is None:
                    deadline = time.monotonic() + SETTLE_S
    finally:
        if running:
            engine.cancel(list(running))
            for ref, node in running.items():  # resolved once the worker is gone
                attempt.outcomes.setdefault(node.node_id, engine.outcome(node, ref))
    return attempt


def run_across_nodes(
    c: ClusterParams,
    nproc: int,
    module: str,
    args: list[str],
    before_attempt: Callable[[int], None] = lambda attempt: None,
    check_nodes: Callable[[list[engine.Node]], None] = lambda nodes: None,
    exclude: frozenset[str] = frozenset(),
    env_for: Callable[[engine.Node], dict[str, str]] = lambda node: {},
    servers_lost: Callable[[], list[str]] = lambda: [],
) -> dict:
    """Train on cluster.training_nodes nodes x `nproc` processes; returns the provenance record.

    `before_attempt(n)` runs before attempt n (1, 2, ...): it tidies the checkpoints so the
    agents resume from the last complete epoch. `check_nodes` vets the first attempt's nodes.
    `exclude`: node ids never used (online training's inference pool); `env_for(node)`: what
    that node's agent gets on top of the run's environment (its Mooncake address).
    `servers_lost()`: after a failed attempt, the inference servers (online mode) found gone
    since; any: the attempt was lost with them, and the next one uses the servers left.
    """
    n = c.training_nodes
    lost: set[str] = set()  # node ids gone from the cluster
    history: list[dict] = []
    t0 = time.monotonic()
    for number in range(1, c.max_attempts + 1):
        try:
            nodes = engine.choose_nodes(c, exclude=lost | exclude, count=n)
        except PipelineError as exc:
            if number == 1:
                raise
            raise PipelineError(
                f"cluster: train needs {n} nodes but too few are alive after a node was lost "
                f"({exc}); rerun once nodes are back: it resumes from the last complete epoch"
            ) from None
        if number == 1:
            check_nodes(nodes)
        before_attempt(number)
        host = nodes[0]
        endpoint = f"{host.address}:{c.rdzv_port}"
        run_id = f"eagle3-train-{secrets.token_hex(6)}"
        log(
            STAGE,
            f"cluster: attempt {number}: torchrun on {n} nodes x {nproc} processes "
            f"({', '.join(x.label for x in nodes)}), rendezvous {endpoint} on {host.label}",
        )

        def argv_for(i: int, node: engine.Node, endpoint: str = endpoint, run_id: str = run_id):
            return agent_command(
                nnodes=n,
                nproc=nproc,
                endpoint=endpoint,
                run_id=run_id,
                is_host=i == 0,
                local_addr=node.address,
                module=module,
                args=args,
            )

        attempt = _run_attempt(nodes, argv_for, c, env_for, nproc)
        history.append(
            {
                "attempt": number,
                "nodes": [x.label for x in nodes],
                "rendezvous": host.label,
                "agents": [
                    {
                        "node": o.node.label,
                        "rc": o.rc,
                        "error": o.error or None,
                        "cancelled": o.node.label in attempt.cancelled or None,
                        "command_s": o.command_s,
                    }
                    for o in attempt.outcomes.values()
                ],
            }
        )
        if attempt.ok:
            return {
                "engine": "ray",
                "nodes": [x.label for x in nodes],
                "rendezvous": host.label,
                "rdzv_port": c.rdzv_port,
                "nproc_per_node": nproc,
                "world_size": n * nproc,
                "attempts": history,
                "train_s": round(time.monotonic() - t0, 3),
            }
        alive = {x.node_id for x in engine.alive_nodes()}
        gone = [x for x in nodes if x.node_id not in alive]
        servers = servers_lost()
        if servers:
            history[-1]["servers_lost"] = servers
        if not attempt.lost and not gone and not servers:
            failed = next(o for o in attempt.outcomes.values() if o.rc != 0)
            raise PipelineError(
                f"cluster: train's torchrun agent on {failed.node.label} failed (exit "
                f"{failed.rc}): its error is above; fix it and rerun (it resumes from the last "
                "complete epoch)"
            )
        lost |= {x.node_id for x in gone} | {o.node.node_id for o in attempt.lost if o.node_died}
        what = "; ".join(
            [f"{o.node.label}: {o.error.split('. ')[0] or f'exit {o.rc}'}" for o in attempt.lost]
            + [f"{x.label}: node gone" for x in gone]
            + [f"{label}: inference server gone" for label in servers]
        )
        what_lost = "a node" if attempt.lost or gone else "an inference server"
        log(
            STAGE,
            f"cluster: attempt {number} lost {what_lost} ({what}); "
            + (
                "relaunching on alive nodes from the last complete epoch"
                if number < c.max_attempts
                else "no attempts left"
            ),
        )
    raise PipelineError(
        f"cluster: train lost a node in each of {c.max_attempts} attempts (cluster.max_attempts): "
        "check the nodes, then rerun; it resumes from the last complete epoch"
    )
