"""Before a stage fans out: every node sees this run's data/ and the verifier, or one line says
which node lacks which path, before any model loads.

Shared data/ is proved, not assumed: the driver writes a random token under data/.work/ and each
node must read the same token back at the same path (a node with its own local data/ reads
nothing, or another run's token).
"""

from __future__ import annotations

import os
import secrets
import sys
from pathlib import Path

from eagle3_pipeline.cluster import engine
from eagle3_pipeline.config.training_params import ClusterParams
from eagle3_pipeline.core import atomic, paths
from eagle3_pipeline.core.errors import PipelineError

PROBE = paths.SCRATCH / "cluster" / "probe"


def _look(repo: str, probe: str, verifier: str | None, python: str) -> dict:
    """On a node: what it sees at the driver's paths."""
    import socket

    def read(path: Path) -> str | None:
        try:
            return path.read_text()
        except OSError:
            return None

    found: dict = {"host": socket.gethostname(), "repo": os.path.isdir(repo)}
    found["probe"] = read(Path(repo) / probe)
    found["python"] = os.access(python, os.X_OK)
    if verifier is not None:
        where = Path(verifier) if os.path.isabs(verifier) else Path(repo) / verifier
        found["verifier"] = (where / "config.json").is_file() and any(where.glob("*.safetensors"))
    return found


def check(nodes: list[engine.Node], c: ClusterParams, verifier_path: str | None) -> None:
    """Refuse, naming the node and the path, unless every node shares data/ and has the verifier.

    verifier_path: checked when it is a folder here (a local path or a mount); a hub id resolves
    through each node's own cache when the model loads.
    """
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    token = secrets.token_hex(16)
    atomic.write_text(PROBE, token)
    check_verifier = verifier_path if verifier_path and Path(verifier_path).is_dir() else None
    look = ray.remote(_look)
    refs = {
        n: look.options(
            num_cpus=0,
            max_retries=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(n.node_id, soft=False),
        ).remote(os.getcwd(), str(PROBE), check_verifier, sys.executable)
        for n in nodes
    }
    try:
        for node, ref in refs.items():
            seen = ray.get(ref, timeout=120)
            if not seen["repo"] or not seen["python"]:
                what = os.getcwd() if not seen["repo"] else sys.executable
                raise PipelineError(
                    f"cluster: node {node.label} ({seen['host']}) has no {what}: the "
                    "repository and its environment must be at the same path on every node "
                    "(a shared filesystem or the same image; docs/cluster.md)"
                )
            if seen["probe"] != token:
                raise PipelineError(
                    f"cluster: node {node.label} ({seen['host']}) does not see this run's "
                    f"{paths.SCRATCH.parent}/ at {os.getcwd()}/{paths.SCRATCH.parent}: data/ must "
                    "be one shared filesystem on every node (docs/cluster.md)"
                )
            if check_verifier is not None and not seen["verifier"]:
                raise PipelineError(
                    f"cluster: node {node.label} ({seen['host']}) has no verifier weights at "
                    f"verifier.path={verifier_path} (config.json + *.safetensors): copy or "
                    "mount them there on every node"
                )
    finally:
        PROBE.unlink(missing_ok=True)
