"""`make cluster-local NODES=2`, `make cluster-down`: a real Ray cluster of N nodes on this machine.

Each node is its own `ray start --block` process (the first one the head), so the nodes have
distinct node ids, raylets and object stores exactly as on N machines; they share this machine's
filesystem, and its address unless `--netns` (NETNS=1) gives each node but the head a network
namespace and an address of its own (cluster/netns.py). Token authentication is on (a
per-cluster token in a 0600 file, never printed), the dashboard is off. Each node runs in its
own session: `down` ends every process of those sessions (Ray's workers included) and nothing
else, so a user's own Ray on this machine is left alone. State: data/.work/cluster/local.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import NoReturn

from eagle3_pipeline.cluster import netns as namespaces
from eagle3_pipeline.core import atomic, paths
from eagle3_pipeline.core.errors import PipelineError

STATE_DIR = paths.SCRATCH / "cluster"
STATE = STATE_DIR / "local.json"
TOKEN = STATE_DIR / "auth_token"
DEFAULT_PORT = 6380
START_TIMEOUT_S = 120.0
TEMP_ROOT = "/tmp/ray"  # the head keeps Ray's default; the other nodes get folders inside


def auth_env(token_path: Path) -> dict[str, str]:
    """What every Ray process of the cluster (nodes, drivers, workers) needs to authenticate."""
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token_path.resolve())}


def read_state(state: Path = STATE) -> dict | None:
    """The running local cluster's record, or None."""
    if not state.is_file():
        return None
    return json.loads(state.read_text())


def _ray_bin() -> str:
    return str(Path(sys.executable).with_name("ray"))


def _alive_nodes(address: str, env: dict[str, str]) -> int:
    """Alive nodes as the GCS sees them, asked from a separate process (no driver left behind)."""
    code = (
        "import ray, sys\n"
        f"ray.init(address={address!r}, logging_level='ERROR', log_to_driver=False)\n"
        "print(sum(n['Alive'] for n in ray.nodes()))\n"
    )
    try:
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=20
        )
    except subprocess.TimeoutExpired:  # the GCS is not up yet
        return 0
    return int(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 and out.stdout else 0


def up(
    nodes: int,
    port: int = DEFAULT_PORT,
    num_cpus: int = 1,
    state: Path = STATE,
    netns: bool = False,
) -> dict:
    """Start `nodes` Ray nodes here (head first); returns the state record once all are alive.
    `netns`: every node but the head in its own network namespace, with its own address."""
    if read_state(state) is not None:
        raise PipelineError(
            f"{state}: a local cluster is already up (make cluster-down first, then "
            "make cluster-local)"
        )
    state.parent.mkdir(parents=True, exist_ok=True)
    token = state.parent / TOKEN.name
    fd = os.open(token, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    env = {**os.environ, **auth_env(token), "RAY_USAGE_STATS_ENABLED": "0"}
    layout = namespaces.Layout(port, nodes) if netns else None
    address = f"{layout.address(0) if layout else '127.0.0.1'}:{port}"
    common = ["--block", "--num-cpus", str(num_cpus), "--disable-usage-stats"]
    record: dict = {"address": address, "token_path": str(token.resolve()), "nodes": []}
    if layout is not None:
        record["netns"] = {"port": port, "nodes": nodes}
        atomic.write_json(state, record)  # before the first link: `down` removes what exists
        try:
            namespaces.create(layout)
        except PipelineError:
            down(state)
            raise
    procs: list[subprocess.Popen] = []
    for i in range(nodes):
        if i == 0:
            cmd = [_ray_bin(), "start", "--head", f"--port={port}", "--include-dashboard=false"]
        else:
            # Its own temp dir: nodes sharing one would each forward every worker's log lines
            # to the driver (Ray's log monitor tails the whole session folder), so all doubled.
            tmp = f"{TEMP_ROOT}/eagle3-p{port}-n{i}"  # short: Ray's socket paths live under it
            cmd = [_ray_bin(), "start", f"--address={address}", f"--temp-dir={tmp}"]
        if layout is not None:
            cmd = namespaces.wrap(layout, i, [*cmd, f"--node-ip-address={layout.address(i)}"])
        log_path = state.parent / f"node-{i}.log"
        with open(log_path, "wb") as log:
            procs.append(
                subprocess.Popen(
                    cmd + common,
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        record["nodes"].append({"pid": procs[-1].pid, "log": str(log_path)})
        atomic.write_json(state, record)  # written at once: `down` finds what was started
        if i == 0 and not _wait(lambda: _listening(address), START_TIMEOUT_S, procs):
            _fail(state, record, procs, f"the head did not listen at {address}")
    # The other nodes only need the head's GCS to join: they start together, then one wait.
    if not _wait(lambda: _alive_nodes(address, env) >= nodes, START_TIMEOUT_S, procs):
        _fail(state, record, procs, f"not all {nodes} nodes joined")
    for i in range(nodes):
        where = f"at {layout.address(i)}, " if layout is not None else ""
        role = "head" if i == 0 else f"joined {address}"
        print(f"cluster-local: node {i} up ({where}{role})", flush=True)
    return record


def _wait(ready, timeout_s: float, procs: list[subprocess.Popen]) -> bool:
    """Whether `ready()` held within timeout_s, while every node process in `procs` ran."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(proc.poll() is not None for proc in procs):
            return False
        if ready():
            return True
        time.sleep(0.25)
    return False


def _listening(address: str) -> bool:
    """Whether the head's GCS accepts connections at `host:port` (no Ray import needed)."""
    host, port = address.rsplit(":", 1)
    with contextlib.suppress(OSError), socket.create_connection((host, int(port)), timeout=1):
        return True
    return False


def _fail(state: Path, record: dict, procs: list[subprocess.Popen], what: str) -> NoReturn:
    """Stop what started, then name the first node that exited (or `what`) and its log."""
    dead = next((i for i, proc in enumerate(procs) if proc.poll() is not None), None)
    if dead is None:
        what, dead = f"{what} in {START_TIMEOUT_S:.0f} s", len(procs) - 1
    else:
        what = f"node {dead} exited ({procs[dead].returncode})"
    down(state)
    raise PipelineError(f"local cluster: {what}: see {record['nodes'][dead]['log']}")


def _session_pids(sid: int) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if os.getsid(int(entry.name)) == sid:
                    pids.append(int(entry.name))
    return pids


def down(state: Path = STATE) -> int:
    """Stop every process of the local cluster's node sessions; returns how many were signalled."""
    record = read_state(state)
    if record is None:
        return 0
    sessions = [n["pid"] for n in record["nodes"]]  # each node leads its own session
    pids = [p for sid in sessions for p in _session_pids(sid)]
    for sig, grace in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        left = [p for p in pids if _alive(p)]
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(_alive(p) for p in left):
            time.sleep(0.2)
    if "netns" in record:
        namespaces.remove(namespaces.Layout(record["netns"]["port"], record["netns"]["nodes"]))
    state.unlink(missing_ok=True)
    (state.parent / TOKEN.name).unlink(missing_ok=True)
    return len(pids)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is gone for our purpose.
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    start = sub.add_parser("up", help="start N local nodes")
    start.add_argument("--nodes", type=int, default=2)
    start.add_argument("--port", type=int, default=DEFAULT_PORT)
    start.add_argument("--num-cpus", type=int, default=1)
    start.add_argument(
        "--netns", action="store_true", help="each node but the head its own network namespace"
    )
    sub.add_parser("down", help="stop the local cluster")
    args = parser.parse_args(argv)
    try:
        if args.command == "up":
            if args.nodes < 1:
                raise PipelineError(f"NODES={args.nodes}: need at least 1 node")
            record = up(args.nodes, args.port, args.num_cpus, netns=args.netns)
            print(
                f"cluster-local: {args.nodes} nodes at {record['address']} (token auth on); "
                "params: cluster.engine: ray, cluster.address: auto; stop: make cluster-down",
                flush=True,
            )
        else:
            n = down()
            print(f"cluster-down: {n} processes stopped" if n else "cluster-down: none running")
    except PipelineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
