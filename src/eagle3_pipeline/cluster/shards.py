"""Fan a sharded stage out to the cluster: shard i of n runs as `eagle3 <stage> --shard i/n` on a
node; a shard whose worker is lost reruns on another node, resuming from what it journaled.

The shard plan is the stage's own (extract: batches i, i+n, ... of the one length-sorted plan), so
which node ran a shard, or how often it was restarted, cannot change a byte of the result; the
plain stage run that follows on the driver merges the shards into the one output.
"""

from __future__ import annotations

import time

from eagle3_pipeline.cluster import engine
from eagle3_pipeline.config.training_params import ClusterParams
from eagle3_pipeline.core.errors import PipelineError
from eagle3_pipeline.core.progress import log


def run_shards(stage: str, params_path: str, c: ClusterParams) -> dict:
    """Run every shard of `stage` on the cluster; returns the provenance: which node did which."""
    nodes = engine.choose_nodes(c)
    n = len(nodes)
    log(stage, f"cluster: {n} shards on {n} nodes ({', '.join(x.label for x in nodes)})")
    todo = list(range(n))  # shards not yet placed
    attempts = dict.fromkeys(todo, 0)
    running: dict = {}  # ref -> (shard, node)
    idle = list(nodes)
    lost: set[str] = set()
    done: dict[int, str] = {}
    history: list[dict] = []
    t0 = time.monotonic()
    try:
        while todo or running:
            while todo and idle:
                shard, node = todo.pop(0), idle.pop(0)
                attempts[shard] += 1
                argv = engine.eagle3_argv(stage, "--params", params_path, "--shard", f"{shard}/{n}")
                running[engine.submit(node, argv, c)] = (shard, node)
            if todo and not running:
                raise PipelineError(
                    f"cluster: shards {todo} of {stage} have no node left to run on (lost: "
                    f"{', '.join(sorted(lost))}): add nodes, then rerun (finished work is kept)"
                )
            ref = engine.wait_any(list(running))
            shard, node = running.pop(ref)
            out = engine.outcome(node, ref)
            history.append(
                {
                    "shard": shard,
                    "node": node.label,
                    "rc": out.rc,
                    "error": out.error or None,
                    "command_s": out.command_s,
                }
            )
            if out.rc == 0:
                done[shard] = node.label
                log(stage, f"cluster: shard {shard}/{n} done on {node.label}")
                idle.append(node)
                continue
            if not out.lost:
                raise PipelineError(
                    f"cluster: {stage} shard {shard}/{n} failed on {node.label} (exit "
                    f"{out.rc}): its error is above; fix it and rerun"
                )
            if attempts[shard] >= c.max_attempts:
                raise PipelineError(
                    f"cluster: {stage} shard {shard}/{n} lost {attempts[shard]} times (last on "
                    f"{node.label}: {out.error or f'exit {out.rc}'}): raise cluster.max_attempts "
                    "or check the nodes; rerun keeps finished batches"
                )
            log(
                stage,
                f"cluster: shard {shard}/{n} lost on {node.label} "
                f"({out.error or f'exit {out.rc}'}); rerunning it elsewhere from its journal",
            )
            still = {x.node_id for x in engine.alive_nodes()}
            if node.node_id in still and out.rc is not None:
                idle.append(node)  # the node lives, only the worker died: it may take work again
            else:
                lost.add(node.label)
            todo.append(shard)
            idle.sort(key=lambda x: x.node_id == node.node_id)  # another node first
    finally:
        engine.cancel(list(running))
    return {
        "engine": "ray",
        "nodes": [x.label for x in nodes],
        "shards": {f"{s}/{n}": done[s] for s in sorted(done)},
        "attempts": history,
        "fan_out_s": round(time.monotonic() - t0, 3),
    }
