"""generate across a real 2-node Ray cluster (the project's own `make cluster-local`): one vLLM
server per node, each on its node's address with the run's API key on every route; one server
killed mid-run, its prompts finished on the other node; the rows byte-identical to a
single-node run at generate.concurrency 1 (the condition under which greedy rows are the same
bytes at all: docs/cluster.md); the provenance names both nodes and the re-leased prompts.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
import yaml
from generate_workspace import prepare_rows
from ray_cluster import NETNS, local_cluster
from server_procs import server_key, server_pids

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.cluster]

N_ROWS = 16
GENERATE = {
    "backend": "vllm",
    "concurrency": 1,
    "max_new_tokens": 96,
    "temperature": 0.0,
    "chat_template_kwargs": {"thinking": True},
}  # servers on ports 8410-8419: the cluster's from 8410, the single node's 8416
READY = re.compile(r"cluster: server on (\S+) ready at (http://\S+)")
SENDING = "prompts to 2 servers"


def _env() -> dict[str, str]:
    return os.environ | {"OMP_WAIT_POLICY": "PASSIVE", "HF_HUB_OFFLINE": "1"}


def _workspace(root: Path, verifier: Path, port: int, cluster: dict | None = None) -> Path:
    root.mkdir()
    prepare_rows(root, N_ROWS)
    generate = GENERATE | {"server_port": port}
    raw = {"seed": 7, "verifier": {"path": str(verifier)}, "generate": generate}
    if cluster:
        raw["cluster"] = cluster
    (root / "params.yaml").write_text(yaml.safe_dump(raw))
    return root


def _eagle3(root: Path, log: Path) -> subprocess.Popen:
    with open(log, "w") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "eagle3_pipeline.cli", "generate"],
            cwd=root,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=_env(),
        )


def _outputs(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((root / "data/generated").iterdir())}


def _signal_server(port: int, sig: int) -> None:
    """`sig` to the server on `port`: its watchdog's process group (watchdog, API server and
    engine), not the Ray worker that started it."""
    os.killpg(os.getpgid(server_pids(port)[0]), sig)


def _wait_for(what: str, check, proc: subprocess.Popen, log: Path, timeout_s: float = 600):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        assert proc.poll() is None, f"stage ended before {what}:\n{log.read_text()[-3000:]}"
        time.sleep(0.1)
    raise AssertionError(f"no {what} in {timeout_s:.0f} s:\n{log.read_text()[-3000:]}")


def _journaled(root: Path) -> int:
    journal = root / "data/.work/generate/done.jsonl"
    return journal.read_bytes().count(b"\n") if journal.exists() else 0


def test_generate_across_two_nodes_survives_a_killed_server_with_identical_rows(
    tmp_path: Path, tiny_verifier_dir: Path
) -> None:
    t0 = time.time()
    # The single-node run goes on beside the cluster's start and run (its own server and port).
    single = _workspace(tmp_path / "single", tiny_verifier_dir, 8416)
    single_log = tmp_path / "single.log"
    single_run = _eagle3(single, single_log)

    two = _workspace(tmp_path / "two", tiny_verifier_dir, 8410, {"engine": "ray", "nodes": 2})
    log = tmp_path / "two.log"
    # As root, each node but the head in its own network namespace (ray_cluster.NETNS): a server
    # bound to another node's address (or to 0.0.0.0) would not be found where the stage says.
    with local_cluster(two, 2, (6410, 6420), netns=True), contextlib.ExitStack() as stack:
        stack.callback(lambda: single_run.poll() is None and single_run.kill())
        proc = _eagle3(two, log)
        try:
            ready = _wait_for(
                "two servers",
                lambda: (found := READY.findall(log.read_text())) and len(found) == 2 and found,
                proc,
                log,
            )
            (node_a, url_a), (node_b, url_b) = ready
            # Frozen only once the stage has asked both what they serve and leases prompts.
            _wait_for("the first leases", lambda: SENDING in log.read_text(), proc, log)
            assert node_a != node_b and url_a != url_b
            if NETNS:  # each server on its own node's address
                assert url_a.split(":")[1] != url_b.split(":")[1], (url_a, url_b)
                assert node_a.split("/")[0] in url_a and node_b.split("/")[0] in url_b
            port_a, port_b = (int(u.rsplit(":", 1)[1]) for u in (url_a, url_b))

            # Both servers frozen at once: on 2 shared cores the 16 rows take seconds, less
            # than this test's own requests, so the run is paused for them. Each frozen server
            # holds the lease its thread sent it while prompts are queued.
            _signal_server(port_a, signal.SIGSTOP)
            _signal_server(port_b, signal.SIGSTOP)
            for port, url in ((port_a, url_a), (port_b, url_b)):
                _signal_server(port, signal.SIGCONT)
                # No open door: the run's key on every route but /health.
                assert requests.get(f"{url}/health", timeout=10).status_code == 200
                assert requests.get(f"{url}/v1/models", timeout=10).status_code == 401
                assert requests.get(f"{url}/metrics", timeout=10).status_code == 401
                assert requests.post(f"{url}/invocations", json={}, timeout=10).status_code == 401
                _signal_server(port, signal.SIGSTOP)
            key = server_key(server_pids(port_b)[0]).encode()  # bytes: searched for in files

            # Mid-run: with at least 3 rows unanswered, A and B each hold at most one lease and
            # the queue is not empty, so B's thread holds one (sent, or about to be, to B).
            assert _journaled(two) <= N_ROWS - 3, "the run was nearly over before the freeze"
            _signal_server(port_b, signal.SIGKILL)  # the server, not its worker
            _signal_server(port_a, signal.SIGCONT)
            assert proc.wait(timeout=600) == 0, log.read_text()[-3000:]
        finally:
            for port in range(8410, 8420):  # nothing left frozen, whatever failed
                with contextlib.suppress(IndexError, ProcessLookupError):
                    _signal_server(port, signal.SIGCONT)
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        ports = [port_a, port_b]
        deadline = time.monotonic() + 60
        while any(map(server_pids, ports)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(map(server_pids, ports)), "a server outlived the stage"
        assert single_run.wait(timeout=600) == 0, single_log.read_text()[-3000:]

    assert _outputs(two) == _outputs(single)  # same bytes as the single-node run
    text = log.read_text()
    assert f"server {node_b} lost" in text

    prov = json.loads((two / "metrics/provenance/generate.json").read_text())
    rec = prov["cluster"]
    assert rec["engine"] == "ray" and set(rec["servers"]) == {node_a, node_b}
    assert sum(s["rows"] for s in rec["servers"].values()) == N_ROWS
    assert [x["server"] for x in rec["lost"]] == [node_b]
    released = rec["lost"][0]["released"]
    assert released and set(released) <= set(rec["servers"][node_a]["ids"])
    assert rec["re_leased"] == released

    # The key: in no log (the stage's, the servers', Ray's), row, journal or record.
    ray_logs = [p for p in Path("/tmp/ray").rglob("*") if _written_since(p, t0)]
    for path in [*tmp_path.rglob("*"), *ray_logs]:
        if path.is_file() and path.stat().st_size < 50_000_000:
            with contextlib.suppress(OSError):
                assert key not in path.read_bytes(), path


def _written_since(path: Path, t0: float) -> bool:
    with contextlib.suppress(OSError):
        return path.is_file() and path.stat().st_mtime >= t0
    return False
