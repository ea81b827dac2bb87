"""Online training across nodes: vLLM on an inference pool, torchrun on a training pool.

TorchSpec's shape on our engine. With `cluster.engine: ray`, `train.hidden_states: online` and no
`train.online.endpoint`, the first `cluster.nodes - cluster.training_nodes` nodes are the inference
pool and the rest the training pool (torchrun agents run there only). Every inference node serves
the verifier with `extract_hidden_states` (a cluster/servers.py ServerWorker actor pinned to it,
listening on its cluster address); speculators' dataloader takes one `--vllm-endpoint`, so each
training rank is given one of those servers, round robin by global rank (online_training/source.py
`endpoint_for_rank`); with `backend: mooncake`, only where two servers on one master are shown to
work (`serving_nodes`). With `train.online.backend: mooncake` the first inference node also runs
`mooncake_master` (a MasterWorker actor, bound to the node's address, stopped at the end) unless
params.yaml names `train.online.mooncake.master`. Every Mooncake client registers its own node's
address (MOONCAKE_LOCAL_HOSTNAME): each server its node's, each trainer its node's, the driver
(whose pre-flight probe reads one sample from every server) its own. With `backend: file` the
servers write into the run's scratch folder, which the cluster pre-flight guarantees every node
shares.

The servers listen on their node's cluster address only, never 0.0.0.0, and want the run's own
API key on every route but /health; the trainers get the key in their environment (speculators'
client is patched to send it: training/speculators_patches.online_api_key).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3_pipeline.cluster import engine
from eagle3_pipeline.config.params import VllmParams
from eagle3_pipeline.config.training_params import (
    ClusterParams,
    MooncakeParams,
    OnlineParams,
    TrainParams,
)
from eagle3_pipeline.core.errors import ParamsError, ServerError
from eagle3_pipeline.core.progress import log
from eagle3_pipeline.in_vllm import auth, entry_points
from eagle3_pipeline.in_vllm.server_entry import cpu_worker_in_engine_core
from eagle3_pipeline.online_training.source import ENDPOINTS_VAR, OnlineSource
from eagle3_pipeline.online_training.source import trainer_env as online_trainer_env
from eagle3_pipeline.training.online_backend import LOCAL_HOSTNAME_VAR
from eagle3_pipeline.verifier.identity import VerifierFacts

STAGE = "train"
MASTER_READY_S = 30.0
STOP_TIMEOUT_S = 60.0
# hs_connectors' Mooncake connector needs an accelerator; ours is the same on one and falls back
# to the CPU without (the driver cannot tell what the inference node has).
CPU_MOONCAKE_CONNECTOR = "CPUMooncakeHiddenStatesConnector"
ONE_SERVER = "two servers on one Mooncake master: only CPU servers with their default executor"


def uses_pools(t: TrainParams, c: ClusterParams) -> bool:
    """Online training whose server this stage starts on a Ray cluster: separate pools."""
    return c.engine == "ray" and t.hidden_states == "online" and not t.online.endpoint


def inference_count(c: ClusterParams) -> int:
    """Nodes of the inference pool (cluster.nodes - cluster.train_nodes), or refuse."""
    n = c.nodes - c.training_nodes
    if n < 1:
        raise ParamsError(
            f"params.yaml: cluster.train_nodes={c.training_nodes} leaves no inference node of "
            f"cluster.nodes={c.nodes} for online training's vLLM server: set cluster.train_nodes "
            f"below cluster.nodes (e.g. {max(c.nodes - 1, 1)}), raise cluster.nodes, or give "
            "train.online.endpoint"
        )
    return n


def given_master(o: OnlineParams) -> str | None:
    """train.online.mooncake.master when params.yaml sets it (used as is), else None (started)."""
    return o.mooncake.master if "master" in o.mooncake.model_fields_set else None


def split_pools(
    nodes: list[engine.Node], c: ClusterParams
) -> tuple[list[engine.Node], list[engine.Node]]:
    """(inference pool, training pool): the first cluster.nodes - train_nodes nodes, the rest."""
    n = inference_count(c)
    return nodes[:n], nodes[n : c.nodes]


class MasterWorker:
    """The actor's body: `mooncake_master` on this node, bound to its cluster address."""

    def __init__(self, cwd: str) -> None:
        os.chdir(cwd)
        self.proc: subprocess.Popen | None = None

    def start(self, host: str, log_file: str) -> str:
        """Start the master on free ports of `host`; its host:port once it listens."""
        rpc_port, metrics_port = _free_port(host), _free_port(host)
        cmd = [
            str(Path(sys.executable).parent / "mooncake_master"),
            f"--rpc_address={host}",
            f"--rpc_port={rpc_port}",
            f"--metrics_host={host}",
            f"--metrics_port={metrics_port}",
            "--logtostderr",
        ]
        Path(log_file).parent.mkdir(parents=True, exist_ok=True)
        with open(log_file, "wb") as out:
            self.proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True, preexec_fn=engine._die_with_parent,
            )  # fmt: skip
        deadline = time.monotonic() + MASTER_READY_S
        while True:
            if self.proc.poll() is not None:
                raise ServerError(
                    f"mooncake_master on {host} exited {self.proc.returncode} (log: {log_file})"
                )
            with contextlib.suppress(OSError), socket.create_connection((host, rpc_port), 0.5):
                return f"{host}:{rpc_port}"
            if time.monotonic() > deadline:
                self.stop()
                raise ServerError(
                    f"mooncake_master not listening on {host}:{rpc_port} after "
                    f"{MASTER_READY_S:.0f} s (log: {log_file})"
                )
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


def serving_nodes(
    inference: list[engine.Node], mooncake: bool, num_gpus: float, env: Mapping[str, str]
) -> list[engine.Node]:
    """The inference nodes that start a server: every one, except with Mooncake where two
    servers on one master have not been shown to work, and there only the first. That is a CPU
    server whose worker runs in a process of its own (VLLM_ENABLE_V1_MULTIPROCESSING, as the
    driver passes it, set to anything but 0: two such servers failed on a namespaced local
    cluster, the master expired one server's client and its puts were lost) and any GPU server
    (not run yet). Our CPU servers keep the worker inside the engine core process by default
    (in_vllm/server_entry.py), and two of them serve."""
    own_worker_process = num_gpus > 0 or not cpu_worker_in_engine_core(env)
    return inference[:1] if mooncake and own_worker_process else list(inference)


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class Pools:
    """The started inference side (one server per inference node) and the training nodes."""

    sources: list[OnlineSource]
    inference: list[engine.Node]
    training: list[engine.Node]
    master: str | None  # the Mooncake master's host:port (backend mooncake)
    record: dict = field(default_factory=dict)  # provenance: who served, where the master ran
    watchers: list[Callable[[], str | None]] = field(default_factory=list)  # per server: why gone
    lost: set[int] = field(default_factory=set)  # servers (indexes) found gone

    @property
    def alive(self) -> list[OnlineSource]:
        return [s for i, s in enumerate(self.sources) if i not in self.lost]

    @property
    def source(self) -> OnlineSource:
        """The first server alive: the one params name (what a worker falls back to)."""
        return (self.alive or self.sources)[0]

    def trainer_env(self, node: engine.Node) -> dict[str, str]:
        """What a training node's agent (and its workers) needs on top of the run's env: the
        servers alive (each rank takes one by its rank), their key, with Mooncake its address."""
        mooncake = {LOCAL_HOSTNAME_VAR: node.address} if self.master else {}
        endpoints = {ENDPOINTS_VAR: ",".join(s.endpoint for s in self.alive)}
        return online_trainer_env(self.source) | endpoints | mooncake

    def newly_lost(self) -> list[str]:
        """Servers found gone since the last call (their worker ended or their node died, or
        /health does not answer): marked lost, named. None left alive: ServerError."""
        found = []
        for i, source in enumerate(self.sources):
            if i in self.lost:
                continue
            gone = i < len(self.watchers) and self.watchers[i]()
            if gone or not _healthy(source):
                self.lost.add(i)
                self.record["vllm"][i]["lost"] = True
                found.append(self.record["vllm"][i]["node"])
        if found and not self.alive:
            raise ServerError(
                f"cluster: every inference server was lost (last: {', '.join(found)}): bring "
                "the inference nodes back and rerun; it resumes from the last complete epoch"
            )
        started_master = self.master and not self.record.get("mooncake_master", {}).get("given")
        if started_master and self.record["vllm"][0]["node"] in found:
            raise ServerError(
                f"cluster: the first inference node {found[0]} was lost, and the Mooncake master "
                "the stage ran there with it: rerun once it is back (it resumes from the last "
                "complete epoch), or run a master elsewhere (train.online.mooncake.master)"
            )
        return found

    def served(self) -> dict[str, Any]:
        """The provenance record with each live server's answered requests (its /metrics)."""
        from eagle3_pipeline.serving.server import answered

        for i, (entry, source) in enumerate(zip(self.record["vllm"], self.sources, strict=True)):
            if i not in self.lost:
                with contextlib.suppress(OSError, ValueError):
                    entry["requests"] = answered(
                        source.endpoint.removesuffix("/v1"), source.api_key
                    )
        return self.record


def _healthy(source: OnlineSource) -> bool:
    from eagle3_pipeline.serving.server import healthy

    return healthy(source.endpoint.removesuffix("/v1"), timeout_s=5.0)


def mooncake_kv_config(m: MooncakeParams, master: str, host: str) -> dict:
    """hs_connectors' vLLM-side Mooncake config for a server on `host`, with our connector
    (`m`: params' train.online.mooncake)."""
    import argparse

    from hs_connectors import MooncakeBackend

    parser = argparse.ArgumentParser()
    MooncakeBackend.add_launch_args(parser)
    args = parser.parse_args(
        [
            f"--mooncake-master={master}",
            f"--mooncake-metadata-server={m.metadata_server}",
            f"--mooncake-protocol={m.protocol}",
            f"--mooncake-device={m.device}",
            f"--mooncake-global-segment-gib={m.global_segment_gib}",
            f"--mooncake-local-buffer-gib={m.local_buffer_gib}",
        ]
    )
    config = MooncakeBackend.build_kv_transfer_config(args)
    config["kv_connector_extra_config"]["mooncake"]["local_hostname"] = host
    config["kv_connector"] = CPU_MOONCAKE_CONNECTOR
    config["kv_connector_module_path"] = entry_points.MOONCAKE_CONNECTOR
    return config


def _with_kv_config(extra_args: list[str], config: dict) -> list[str]:
    out = list(extra_args)
    i = out.index("--kv-transfer-config")
    out[i + 1] = json.dumps(config)
    return out


def _started(ref, what: str, node: engine.Node) -> str:
    """What an actor's start returned, or one line naming the node and the cause."""
    import ray

    try:
        return ray.get(ref)
    except (ray.exceptions.RayError, ServerError) as exc:
        cause = getattr(exc, "cause", None) or exc
        first = (str(cause).strip().splitlines() or [type(cause).__name__])[-1]
        raise ServerError(f"cluster: no {what} on {node.label}: {first}") from None


@contextlib.contextmanager
def inference_pool(
    c: ClusterParams,
    o: OnlineParams,
    verifier: VerifierFacts,
    v: VllmParams,
    layer_ids: list[int],
    work: Path,
) -> Iterator[Pools]:
    """Start the inference pool's server (and master) of `verifier` with params' `vllm`; yield
    the pools; always stop both."""
    inference_count(c)  # refuse before connecting
    engine.connect(c)
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from eagle3_pipeline.cluster import preflight
    from eagle3_pipeline.cluster.servers import ServerWorker, watcher
    from eagle3_pipeline.serving.hidden_states import clear_dir, hidden_state_spec

    nodes = engine.choose_nodes(c)
    preflight.check(nodes, c, verifier.path)
    inference, training = split_pools(nodes, c)
    node = inference[0]
    log(
        STAGE,
        f"cluster: inference pool {', '.join(n.label for n in inference)}; training pool "
        f"{', '.join(n.label for n in training)}",
    )

    def pinned(cls, at: engine.Node, **options):
        return ray.remote(cls).options(
            max_restarts=0,
            max_concurrency=4,
            scheduling_strategy=NodeAffinitySchedulingStrategy(at.node_id, soft=False),
            **options,
        )

    actors = []
    try:
        master = None
        record: dict = {
            "backend": o.backend,
            "pools": {
                "inference": [n.label for n in inference],
                "training": [n.label for n in training],
            },
        }
        if o.backend == "mooncake":
            master = given_master(o)
            if master:
                record["mooncake_master"] = {"address": master, "node": None, "given": True}
            else:
                worker = pinned(MasterWorker, node, num_cpus=0).remote(os.getcwd())
                actors.append(worker)
                log_file = str((work / "mooncake-master.log").resolve())
                master = _started(
                    worker.start.remote(node.address, log_file), "mooncake_master", node
                )
                record["mooncake_master"] = {"address": master, "node": node.label}
                log(STAGE, f"cluster: mooncake_master on {node.label} at {master}")
            # The driver's pre-flight probe is a Mooncake client too: its own node's address.
            os.environ[LOCAL_HOSTNAME_VAR] = ray.util.get_node_ip_address()
        storage = work / "online-hidden-states"
        clear_dir(storage)
        key = auth.run_key()  # one per run, shared by its servers
        serving = serving_nodes(inference, bool(master), c.worker.num_gpus, engine.passed_env())
        if len(serving) < len(inference):
            log(STAGE, f"cluster: vLLM on {serving[0].label} only ({ONE_SERVER}; docs/cluster.md)")
        starts = []
        for i, at in enumerate(serving):
            log_file = work / f"vllm-online-{i}.log"
            spec = hidden_state_spec(verifier, v, layer_ids, storage / str(i), log_file)
            spec.host, spec.api_key = at.address, key  # the node's cluster address only
            if master:
                spec.env = {**(spec.env or {}), LOCAL_HOSTNAME_VAR: at.address}
                kv = mooncake_kv_config(o.mooncake, master, at.address)
                spec.extra_args = _with_kv_config(spec.extra_args, kv)
            server = pinned(
                ServerWorker, at, num_cpus=c.worker.num_cpus, num_gpus=c.worker.num_gpus
            ).remote(os.getcwd(), engine.passed_env())
            actors.append(server)
            log(STAGE, f"cluster: starting vLLM (extract_hidden_states) on {at.label} ({log_file})")
            starts.append((at, log_file, server.start.remote(spec)))
        sources, watchers, record["vllm"] = [], [], []
        for (at, log_file, ref), server in zip(starts, actors[-len(starts) :], strict=True):
            url = _started(ref, "vLLM server", at)  # started side by side, gathered in order
            log(STAGE, f"cluster: vLLM on {at.label} ready at {url}")
            record["vllm"].append({"node": at.label, "url": url})
            name = f"the vLLM server on {at.label} at {url} (log: {log_file})"
            sources.append(OnlineSource(f"{url}/v1", name, key))
            watchers.append(watcher(server.wait.remote()))
        yield Pools(sources, inference, training, master, record, watchers)
    finally:
        stops = [a.stop.remote() for a in reversed(actors)]
        with contextlib.suppress(ray.exceptions.RayError, TimeoutError):
            ray.wait(stops, num_returns=len(stops), timeout=STOP_TIMEOUT_S)
        for a in actors:
            with contextlib.suppress(ray.exceptions.RayError, ValueError):
                ray.kill(a, no_restart=True)
