"""One vLLM server per node for generate, each started and stopped by a worker on its node.

The worker is a Ray actor pinned to the node (hard node affinity). It starts the server with
the project's own machinery (serving/server.py: watchdog, log file, CPU patches) on the node's
cluster address, never 0.0.0.0, with the run's API key, and answers its URL once /health does.
It stops the server when asked, and the server cannot outlive it: the watchdog ends the server
when the worker's pipe closes, and Ray ends the worker when the driver (the stage) dies. The
driver watches each server through its worker (`wait` returns, with the cause, when the
server's watch sees it stop serving, serving/server_process.py; it fails when the worker or its
node is lost), so a lost server is noticed within seconds, without waiting for HTTP retries.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from eagle3_pipeline.cluster import engine
from eagle3_pipeline.config.training_params import ClusterParams
from eagle3_pipeline.core.errors import ServerError
from eagle3_pipeline.core.progress import log
from eagle3_pipeline.serving import server as vllm_server
from eagle3_pipeline.serving import server_process
from eagle3_pipeline.serving.server import ServerSpec

STOP_TIMEOUT_S = 60.0


class ServerWorker:
    """The actor's body: one server on this node, in the repository at the driver's path."""

    def __init__(self, cwd: str, env: dict[str, str]) -> None:
        os.chdir(cwd)  # the actor owns its process: relative paths mean the driver's
        # The server's environment is the driver's, as a server it starts itself would get:
        # Ray sets OMP_NUM_THREADS to the actor's CPUs, which would change vLLM's threads.
        if "OMP_NUM_THREADS" not in env:
            os.environ.pop("OMP_NUM_THREADS", None)
        os.environ.update(env)
        self.proc: subprocess.Popen | None = None
        self.watch: server_process.Watch | None = None

    def start(self, spec: ServerSpec) -> str:
        """Start the server; its base URL once ready (ServerError with its log's tail if not)."""
        started = vllm_server.launch(spec)
        self.proc = started.proc
        try:
            url = vllm_server.wait_ready(started)
        except BaseException:
            self.stop()
            raise
        self.watch = server_process.Watch(started)
        return url

    def wait(self) -> str:
        """Block until the server stops serving (its watch, serving/server_process.py); why, in
        a line."""
        assert self.proc is not None and self.watch is not None
        while self.watch.reason is None and self.proc.poll() is None:
            time.sleep(server_process.WATCH_INTERVAL_S)
        code = self.proc.wait()
        return self.watch.reason or self.watch.describe(server_process.exit_cause(code))

    def stop(self) -> None:
        if self.watch is not None:
            self.watch.close()
        if self.proc is not None:
            server_process.stop(self.proc)


@dataclass
class NodeServer:
    """A started server: its node, URL and a check that answers why once it is gone."""

    node: engine.Node
    url: str
    gone: Callable[[], str | None]


def watcher(ref) -> Callable[[], str | None]:
    """Why the server stopped once `ref` (a worker's `wait`) has returned (its watch's words) or
    failed (the worker or its node was lost); None while it serves."""
    import ray

    def gone() -> str | None:
        ready, _ = ray.wait([ref], timeout=0)
        if not ready:
            return None
        try:
            return str(ray.get(ready[0]))
        except ray.exceptions.RayError as exc:
            return f"its worker or node was lost ({type(exc).__name__})"

    return gone


@contextlib.contextmanager
def node_servers(
    c: ClusterParams,
    spec_for: Callable[[int, engine.Node], ServerSpec],
    verifier_path: str | None,
) -> Iterator[list[NodeServer]]:
    """Start one server on each of cluster.nodes nodes (after the pre-flight); yield those that
    became ready (a node whose server did not start is left out, logged; none: ServerError);
    always stop them and end their workers."""
    engine.connect(c)  # first: it sets what Ray reads when it is imported (the cluster's token)
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from eagle3_pipeline.cluster import preflight

    nodes = engine.choose_nodes(c)
    preflight.check(nodes, c, verifier_path)
    actor_class = ray.remote(ServerWorker)
    workers = []
    try:
        for node in nodes:
            workers.append(
                actor_class.options(
                    num_cpus=c.worker.num_cpus,
                    num_gpus=c.worker.num_gpus,
                    max_restarts=0,
                    max_concurrency=4,  # start, wait and stop at once
                    scheduling_strategy=NodeAffinitySchedulingStrategy(node.node_id, soft=False),
                ).remote(os.getcwd(), engine.passed_env())
            )
        t0 = time.monotonic()
        specs = [spec_for(i, node) for i, node in enumerate(nodes)]
        for node, spec in zip(nodes, specs, strict=True):
            log("generate", f"cluster: starting a server on {node.label} (log: {spec.log_file})")
        starts = [w.start.remote(spec) for w, spec in zip(workers, specs, strict=True)]
        started: list[NodeServer] = []
        errors: list[str] = []
        for node, worker, ref in zip(nodes, workers, starts, strict=True):
            try:
                url = ray.get(ref)
            except (ray.exceptions.RayError, ServerError) as exc:
                cause = getattr(exc, "cause", None) or exc
                first = (str(cause).strip().splitlines() or [type(cause).__name__])[-1]
                errors.append(f"{node.label}: {first}")
                log("generate", f"cluster: no server on {node.label}: {first}")
                continue
            started.append(NodeServer(node, url, watcher(worker.wait.remote())))
            log("generate", f"cluster: server on {node.label} ready at {url}")
        if not started:
            raise ServerError(
                f"cluster: no vLLM server started on any of {len(nodes)} nodes "
                f"({'; '.join(errors)})"
            )
        log(
            "generate",
            f"cluster: {len(started)} of {len(nodes)} servers ready in "
            f"{time.monotonic() - t0:.0f} s",
        )
        yield started
    finally:
        stops = [w.stop.remote() for w in workers]
        with contextlib.suppress(ray.exceptions.RayError, TimeoutError):
            ray.wait(stops, num_returns=len(stops), timeout=STOP_TIMEOUT_S)
        for w in workers:  # the watchdog ends a server its worker did not stop
            with contextlib.suppress(ray.exceptions.RayError, ValueError):
                ray.kill(w, no_restart=True)
