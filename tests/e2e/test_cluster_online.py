"""Online training across nodes of a real local Ray cluster, each node with its own address
(network namespaces, as root), so a server, Mooncake master or client bound to the wrong node's
address fails here. Every row of the tiny workspace is online (no stored row, so the synthetic
store's random hidden states are never compared with the real verifier's).

Both tests share one 3-node cluster (the Mooncake test first: the other one loses a node).

- Mooncake, `cluster.nodes: 3, train_nodes: 1`: the head and one more node are the inference
  pool (one vLLM with extract_hidden_states on each; the Mooncake master on the head, all started
  through Ray), the third node trains (one agent, 2 ranks: each rank asks its own server, both
  servers put into the one master). The stage ends green and its provenance names the nodes that
  served, the requests each answered, the master's node and the node that trained.
- Files, `cluster.nodes: 3, train_nodes: 1`: the head and one more node are the inference pool
  (one vLLM on each), the third node trains (one agent, 2 ranks: each rank asks its own
  server). Once the second server has answered rows of epoch 1 and that epoch's checkpoint is
  complete, its whole node dies (the node's `ray start` session and the server, SIGKILL): the
  attempt is lost with it, and the next one resumes after epoch 1 on the server left. The
  provenance names the servers, the lost one and the requests the other answered.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from ray_cluster import NETNS, free_port, kill_session, local_cluster
from server_procs import server_key, server_pids
from train_workspace import build_workspace, checkpoints, stage_command, stage_env

from eagle3_pipeline.cluster.local import STATE
from eagle3_pipeline.serving.server import answered
from eagle3_pipeline.store import format as store
from eagle3_pipeline.training import checkpoints as ck

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.cluster]
READY = re.compile(r"cluster: vLLM on \S+ ready at (http://\S+)")


def _all_online(root: Path, rdzv_port: int, backend: str, nodes: int) -> None:
    """Online mode on a cluster of `nodes` (one training node); the store holds no sample."""
    params = yaml.safe_load((root / "params.yaml").read_text())
    online = {"backend": backend, "request_timeout_s": 60, "max_retries": 1}
    online |= {"round_trip_retries": 0}
    if backend == "mooncake":
        online["mooncake"] = {"global_segment_gib": 0.0625, "local_buffer_gib": 0.0625}
    params["train"] |= {"hidden_states": "online", "online": online}
    params["cluster"] = {
        "engine": "ray",
        "nodes": nodes,
        "train_nodes": 1,
        "rdzv_port": rdzv_port,
        "wait_for_nodes_s": 30,
    }
    (root / "params.yaml").write_text(yaml.safe_dump(params))
    store_dir = root / "data/hidden_states"
    manifest = store.read_manifest(store_dir)
    for entry in manifest["samples"].values():
        (store_dir / entry["file"]).unlink()
    store.write_manifest(store_dir, store.layout_of(manifest), {})


def _ancestors(pid: int) -> list[int]:
    out = []
    while pid > 1:
        out.append(pid)
        pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    return out


def _kill_node_of(server_pid: int, state: dict) -> None:
    """SIGKILL the server's node (its `ray start` session, never the head's) and the server."""
    sessions = {n["pid"] for n in state["nodes"][1:]}
    sid = next(os.getsid(p) for p in _ancestors(server_pid) if os.getsid(p) in sessions)
    os.killpg(os.getpgid(server_pid), signal.SIGKILL)
    kill_session(sid)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[dict, Path]]:
    """3 nodes, each with its own address (as root); (its state record, its state file)."""
    home = tmp_path_factory.mktemp("cluster")
    with local_cluster(home, nodes=3, ports=(6440, 6480), netns=True) as state:
        assert len(state["nodes"]) == 3, state
        yield state, home / STATE


def _two_servers_one_trainer(record: dict) -> list[str]:
    """Check the cluster record of a run on 2 inference nodes and 1 training node (2 ranks);
    return the nodes that served, in order."""
    online = record["online"]
    served_on = [x["node"] for x in online["vllm"]]
    assert online["pools"]["inference"] == served_on and len(set(served_on)) == 2, record
    assert online["pools"]["training"] == record["nodes"], record
    assert len(record["nodes"]) == 1 and record["nodes"][0] not in served_on, record
    assert record["world_size"] == 2, record
    if NETNS:  # a label is `address/node id`: three machines, as far as the network goes
        assert len({n.split("/")[0] for n in [*served_on, *record["nodes"]]}) == 3, record
    return served_on


def _join(root: Path, state_file: Path) -> None:
    """The workspace's stages find the shared cluster as they find one it started itself."""
    (root / STATE).parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(state_file, root / STATE)


def test_two_servers_on_one_mooncake_master_each_serve_a_rank(
    tiny_verifier_dir: Path, tmp_path: Path, cluster: tuple[dict, Path]
) -> None:
    root = build_workspace(
        tmp_path / "ws", tiny_verifier_dir, n_train=6, n_val=2, train={"epochs": 1, "nproc": 2}
    )
    _all_online(root, free_port(29520, 29530), "mooncake", 3)
    _join(root, cluster[1])
    t0 = time.monotonic()
    proc = subprocess.run(
        stage_command(),
        cwd=root,
        env=stage_env() | {"OMP_WAIT_POLICY": "PASSIVE"},
        capture_output=True,
        text=True,
        timeout=900,
    )
    train_s = time.monotonic() - t0
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"train failed:\n{proc.stdout[-8000:]}\n{proc.stderr[-6000:]}"
    assert (checkpoints(root) / "0" / "model.safetensors").is_file()
    assert "rows from 2 vLLM servers" in out, out[-4000:]
    record = json.loads((root / "metrics/provenance/train.json").read_text())["cluster"]
    online = record["online"]
    served_on = _two_servers_one_trainer(record)
    assert all(x["requests"] >= 1 for x in online["vllm"]), record  # each rank's own server
    assert online["mooncake_master"]["node"] == served_on[0], record
    assert online["backend"] == "mooncake"
    assert "cluster: mooncake_master on" in out, out[-4000:]
    print(f"3-node online train (mooncake, 2 servers) {train_s:.1f} s")


def test_two_servers_one_per_rank_and_a_lost_inference_node_is_survived(
    tiny_verifier_dir: Path, tmp_path: Path, cluster: tuple[dict, Path]
) -> None:
    root = build_workspace(
        tmp_path / "ws", tiny_verifier_dir, n_train=6, n_val=2, train={"epochs": 2, "nproc": 2}
    )
    _all_online(root, free_port(29530, 29540), "file", 3)
    marker = checkpoints(root) / "0" / ck.COMPLETE_MARKER
    log = root / "online-run.log"
    state = cluster[0]
    _join(root, cluster[1])
    t0 = time.monotonic()
    with open(log, "w") as fh:
        proc = subprocess.Popen(
            stage_command(), cwd=root, env=stage_env() | {"OMP_WAIT_POLICY": "PASSIVE"},
            stdout=fh, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 600
        urls: list[str] = []
        while len(urls) < 2 and proc.poll() is None and time.monotonic() < deadline:
            urls = READY.findall(log.read_text())
            time.sleep(0.2)
        assert len(urls) == 2, log.read_text()[-6000:]
        pids = server_pids(int(urls[1].rsplit(":", 1)[1]))
        assert pids, urls[1]
        pid, key = pids[0], server_key(pids[0])
        while proc.poll() is None and time.monotonic() < deadline:
            if marker.is_file() and answered(urls[1], key) >= 1:  # rank 1's rows
                break
            time.sleep(0.02)
        assert marker.is_file(), log.read_text()[-6000:]
        _kill_node_of(pid, state)
        assert proc.wait(timeout=900) == 0, log.read_text()[-8000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    train_s = time.monotonic() - t0
    out = log.read_text()
    assert (checkpoints(root) / "1" / "model.safetensors").is_file()
    assert "lost an inference server" in out and "resumes after epoch 0" in out, out[-6000:]
    assert "rows from 2 vLLM servers (first: the vLLM server on" in out, out[-6000:]
    record = json.loads((root / "metrics/provenance/train.json").read_text())["cluster"]
    online = record["online"]
    servers = online["vllm"]
    served_on = _two_servers_one_trainer(record)
    first, second = record["attempts"]
    assert first["servers_lost"] == [served_on[1]] and "servers_lost" not in second, record
    assert servers[1]["lost"] is True and "lost" not in servers[0], record
    assert servers[0]["requests"] >= 6, record  # its own rank's rows, then the lost one's
    assert online["backend"] == "file"
    print(f"3-node online train, a lost server: {train_s:.1f} s")
