"""Train across 2 nodes of a real local Ray cluster: one torchrun agent per node (gloo, c10d).

Two runs of `eagle3 train` on one tiny workspace (noise_std > 0, so the RNG state matters): on this
machine alone with `train.nproc: 2` (the reference, while the cluster starts), then on a 3-node
cluster, 2 nodes x 1 process, with the second node lost during epoch 2 (every process of its
`ray start` session SIGKILLed, raylet and torchrun agent included, as a machine that dies). The
driver relaunches on the 2 nodes still alive from epoch 1's checkpoint; the run ends with the
reference's weights, bit for bit (same world size, same global ranks, so the same samples per
rank), and its loss curves; the provenance names the nodes of each attempt, the rendezvous host and
the lost node. Then a families branch (`train --family d`, DFlash) on the 2 nodes left equals the
same branch on this machine alone with 2 processes, weight for weight. Each node but the head has
its own network namespace and address (as root), so the rendezvous and gloo run between addresses
as between machines. (Measured once: the same cluster run without the kill also equals the
reference bit for bit.)
"""

from __future__ import annotations

import contextlib
import csv
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import torch
import yaml
from ray_cluster import NETNS, free_port, kill_session, local_cluster
from safetensors.torch import load_file
from train_workspace import build_workspace, checkpoints, stage_command, stage_env

from eagle3_pipeline.cluster.local import STATE
from eagle3_pipeline.training import checkpoints as ck

pytestmark = [pytest.mark.slow, pytest.mark.cluster]
TRAIN = {"epochs": 2, "max_tokens_per_batch": 96}  # ~10 steps per epoch and rank
LAST = 1  # the final epoch's directory
# 1: a special token none of the family workspace's rows holds (DFlash's mask token).
FAMILY = {"d": {"name": "dflash", "block_size": 3, "num_layers": 1, "mask_token_id": 1}}


def _env() -> dict[str, str]:
    return stage_env() | {"OMP_WAIT_POLICY": "PASSIVE"}


def _set_params(root: Path, **sections: dict) -> None:
    path = root / "params.yaml"
    params = yaml.safe_load(path.read_text())
    for key, values in sections.items():
        params[key] = params.get(key, {}) | values
    path.write_text(yaml.safe_dump(params))


def _agents(root: Path, host: int) -> list[int]:
    """Pids of this workspace's torchrun agents with is_host=`host`."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                argv = (entry / "cmdline").read_bytes().split(b"\0")
                text = b" ".join(argv).decode()
                if (
                    "torch.distributed.run" in text
                    and f"--rdzv-conf=is_host={host}" in text
                    and str(root) in text
                ):
                    found.append(int(entry.name))
    return found


def _steps_logged(root: Path) -> int:
    """Training steps rank 0 has logged so far (its DVCLive series in the scratch dir)."""
    found = list((root / "data/.work/train/live").glob("**/train/loss.tsv"))
    return max((len(p.read_text().splitlines()) - 1 for p in found), default=0)


def _run_losing_a_node(root: Path) -> str:
    """Run train; once a step of epoch 2 is logged (read from the files, not from the log, which
    Ray forwards with a delay), kill the whole node that runs the second agent."""
    marker = checkpoints(root) / "0" / ck.COMPLETE_MARKER
    log = root / "killed-run.log"
    with open(log, "w") as fh:
        proc = subprocess.Popen(
            stage_command(), cwd=root, env=_env(), stdout=fh, stderr=subprocess.STDOUT
        )
    killed = False
    try:
        deadline = time.monotonic() + 600
        while proc.poll() is None and not marker.is_file() and time.monotonic() < deadline:
            time.sleep(0.02)
        epoch_1_steps = _steps_logged(root)
        while proc.poll() is None and time.monotonic() < deadline:
            if _steps_logged(root) > epoch_1_steps:
                pids = _agents(root, host=0)
                assert len(pids) == 1, pids
                killed = kill_session(os.getsid(pids[0])) > 0
                break
            time.sleep(0.02)
        proc.wait(timeout=900)
    finally:
        proc.kill()
        proc.wait()
    out = log.read_text()
    assert killed, f"the run ended before epoch 2 started:\n{out[-6000:]}"
    assert proc.returncode == 0, f"train failed after the kill:\n{out[-8000:]}"
    return out


def _series(root: Path, name: str) -> list[tuple[str, str]]:
    with open(root / "metrics/train/plots/metrics" / name) as fh:
        return [(r["step"], r[Path(name).stem]) for r in csv.DictReader(fh, delimiter="\t")]


def _weights(root: Path) -> dict[str, torch.Tensor]:
    path = checkpoints(root) / str(LAST) / ck.EXACT_STATE
    return torch.load(path, weights_only=False)["model"]


def _keep(root: Path, dest: Path) -> None:
    """Keep a run's weights and curves, then clear its outputs and scratch for the next run."""
    dest.mkdir()
    shutil.copy2(checkpoints(root) / str(LAST) / ck.EXACT_STATE, dest / ck.EXACT_STATE)
    shutil.copytree(root / "metrics", dest / "metrics")
    for d in ("data/.work/train", "metrics", "models"):
        shutil.rmtree(root / d, ignore_errors=True)


def _run_family(root: Path) -> tuple[float, dict[str, torch.Tensor]]:
    """`eagle3 train --family d`: its seconds and final weights; then its outputs and scratch
    cleared for the next run."""
    t0 = time.monotonic()
    proc = subprocess.run(
        [*stage_command(), "--family", "d"],
        cwd=root, env=_env(), capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, f"family@d failed:\n{proc.stdout[-6000:]}\n{proc.stderr[-4000:]}"
    assert "drafter dflash" in proc.stdout + proc.stderr
    weights = load_file(str(root / "models/families/d/final/model.safetensors"))
    for d in ("data/.work/train", "models"):
        shutil.rmtree(root / d, ignore_errors=True)
    return time.monotonic() - t0, weights


def _same(a: dict, b: dict) -> list[str]:
    assert a.keys() == b.keys()
    return [k for k in a if not torch.equal(a[k], b[k])]


def test_two_nodes_train_like_two_processes_and_survive_a_lost_node(
    tiny_verifier_dir: Path, tmp_path: Path
) -> None:
    root = build_workspace(tmp_path / "ws", tiny_verifier_dir, n_train=48, train=TRAIN)
    _set_params(root, train={"nproc": 2})
    # The reference run goes on while the cluster starts (Ray's start is mostly waiting).
    with open(tmp_path / "reference.log", "w") as log:
        local_run = subprocess.Popen(
            stage_command(), cwd=root, env=_env(), stdout=log, stderr=subprocess.STDOUT
        )
    t0 = time.monotonic()
    with contextlib.ExitStack() as stack:
        stack.callback(lambda: local_run.poll() is None and local_run.kill())
        stack.enter_context(local_cluster(root, 3, (6400, 6410), netns=True))  # one to spare
        up_s = time.monotonic() - t0
        reference_log = (tmp_path / "reference.log").read_text
        assert local_run.wait(timeout=900) == 0, f"train failed:\n{reference_log()[-6000:]}"
        reference = _weights(root)
        _keep(root, tmp_path / "local")

        rdzv_port = free_port(29500, 29510)
        two_nodes = {"engine": "ray", "nodes": 2, "rdzv_port": rdzv_port, "wait_for_nodes_s": 30}
        _set_params(root, train={"nproc": 1}, cluster=two_nodes)
        t1 = time.monotonic()
        out = _run_losing_a_node(root)
        killed_s = time.monotonic() - t1
        # A families branch (DFlash) in a workspace of its own: on the 2 nodes left, then on
        # this machine alone.
        family = build_workspace(tmp_path / "fam", tiny_verifier_dir, n_train=8, n_val=2)
        (family / STATE).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / STATE, family / STATE)  # the cluster, as its own stages find it
        _set_params(family, families=FAMILY, train=TRAIN | {"nproc": 1}, cluster=two_nodes)
        family_s, family_cluster = _run_family(family)
        family_record = json.loads((family / "metrics/provenance/family@d.json").read_text())
        _set_params(family, train={"nproc": 2}, cluster={"engine": "local", "nodes": 1})
        _, family_local = _run_family(family)
    assert "torchrun through Ray" in out, out[-4000:]
    assert "cluster: attempt 2 resumes after epoch 0" in out, out[-6000:]
    # 2 nodes x 1 process = 1 node x 2 processes, bit for bit, despite the lost agent.
    assert _same(reference, _weights(root)) == []
    for name in ("train/loss.tsv", "val/loss.tsv"):
        assert _series(tmp_path / "local", name) == _series(root, name), name
    assert "lost a node" in out, out[-6000:]
    record = json.loads((root / "metrics/provenance/train.json").read_text())["cluster"]
    assert len(set(record["nodes"])) == 2, record
    assert record["rendezvous"] == record["nodes"][0] and record["world_size"] == 2
    first, second = record["attempts"]
    assert (first["attempt"], second["attempt"]) == (1, 2), record
    lost = [x for x in first["agents"] if x["rc"] is None]  # the other agent: exit 1 (gloo)
    assert [x["node"] for x in lost] == [first["nodes"][1]], record  # the second node's agent
    assert lost[0]["error"].startswith("NodeDiedError"), record
    assert lost[0]["node"] not in second["nodes"] and len(set(second["nodes"])) == 2, record
    assert second["nodes"] == record["nodes"]
    if NETNS:  # a label is `address/node id`: each attempt's nodes at distinct addresses
        for nodes in (first["nodes"], second["nodes"]):
            assert len({n.split("/")[0] for n in nodes}) == 2, record
    # The families branch: 2 nodes x 1 process = 1 node x 2 processes, bit for bit.
    assert _same(family_cluster, family_local) == []
    family_nodes = family_record["cluster"]["nodes"]
    assert len(set(family_nodes)) == 2 and lost[0]["node"] not in family_nodes, family_record
    print(
        f"cluster up {up_s:.1f} s, 2-node train with a lost node {killed_s:.1f} s, "
        f"2-node DFlash branch {family_s:.1f} s"
    )
