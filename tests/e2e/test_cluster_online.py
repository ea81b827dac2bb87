"""Online training across 2 nodes of a real local Ray cluster, hidden states through Mooncake.

`cluster.nodes: 2, train_nodes: 1`: node 0 is the inference pool (vLLM with extract_hidden_states
and the Mooncake master, both started through Ray on it), node 1 the training pool (one torchrun
agent), each with its own address (network namespaces, as root), so a server, Mooncake master or
client bound to the wrong node's address fails here. Every row of the tiny workspace is online (no
stored row, so the synthetic store's random hidden states are never compared with the real
verifier's). The stage ends green and its provenance names the node that served vLLM and the node
that trained.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from ray_cluster import NETNS, free_port, local_cluster
from train_workspace import build_workspace, checkpoints, stage_command, stage_env

from eagle3_pipeline.store import format as store

pytestmark = [pytest.mark.slow, pytest.mark.vllm]


def _all_online(root: Path, rdzv_port: int) -> None:
    """Online mode with mooncake on a 1 + 1 node cluster; the store holds no sample."""
    params = yaml.safe_load((root / "params.yaml").read_text())
    params["train"] |= {
        "hidden_states": "online",
        "online": {
            "backend": "mooncake",
            "request_timeout_s": 60,
            "max_retries": 1,
            "round_trip_retries": 0,
            "mooncake": {"global_segment_gib": 0.0625, "local_buffer_gib": 0.0625},
        },
    }
    params["cluster"] = {
        "engine": "ray",
        "nodes": 2,
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


def test_vllm_on_the_inference_node_trainer_on_the_training_node(
    tiny_verifier_dir: Path, tmp_path: Path
) -> None:
    root = build_workspace(
        tmp_path / "ws", tiny_verifier_dir, n_train=6, n_val=2, train={"epochs": 1}
    )
    _all_online(root, free_port(29520, 29530))
    t0 = time.monotonic()
    with local_cluster(root, nodes=2, ports=(6440, 6460), netns=True) as state:
        assert len(state["nodes"]) == 2, state
        t1 = time.monotonic()
        proc = subprocess.run(
            stage_command(),
            cwd=root,
            env=stage_env() | {"OMP_WAIT_POLICY": "PASSIVE"},
            capture_output=True,
            text=True,
            timeout=900,
        )
        train_s = time.monotonic() - t1
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"train failed:\n{proc.stdout[-8000:]}\n{proc.stderr[-6000:]}"
    assert (checkpoints(root) / "0" / "model.safetensors").is_file()
    record = json.loads((root / "metrics/provenance/train.json").read_text())["cluster"]
    online = record["online"]
    served_on = online["vllm"]["node"]
    assert online["pools"]["inference"] == [served_on], record
    assert online["pools"]["training"] == record["nodes"], record
    assert len(record["nodes"]) == 1 and served_on not in record["nodes"], record
    assert online["mooncake_master"]["node"] == served_on, record
    if NETNS:  # a label is `address/node id`: two machines, as far as the network goes
        assert served_on.split("/")[0] != record["nodes"][0].split("/")[0], record
    assert online["backend"] == "mooncake"
    assert "cluster: mooncake_master on" in out, out[-4000:]
    print(f"2-node online train (mooncake) {train_s:.1f} s, {time.monotonic() - t0:.1f} s in all")
