"""Start, wait for and always stop a vLLM OpenAI-compatible server: the parent side.

The server runs in its own process group on loopback (or the address `host` names: a cluster
node's own address), logs to a file, and is stopped (SIGTERM, then SIGKILL)
and reaped when the `with` block ends for any reason, including Ctrl-C and SIGTERM sent to the
stage. A SIGKILLed stage runs no cleanup at all, so the server is started under a small watchdog
(`python -m eagle3_pipeline.in_vllm.server_entry --watch -- CMD`) that kills the group when its
stdin, a pipe only the stage holds, closes: no server is ever left behind. The server itself is
started through `python -m eagle3_pipeline.in_vllm.server_entry --run MODULE`, which applies the
CPU patches before vLLM's own entry point runs (in_vllm/server_entry.py: the child side). With
`api_key`, every route but /health wants that key (auth.py); the key reaches the server through
its environment only, never its command line or log.

While it serves, a `Watch` asks once a second whether it still does, and stops what is left of
a server that no longer does, with the cause in one line (server_process.py).

Its port: vLLM binds port 0, so the kernel picks a free one at the bind itself, and
`wait_ready` reads which from the server process's listening socket. A port chosen here and
released for vLLM to bind seconds later (after its imports) could be taken by another process
in between: CI once lost a run that way. Only a port range the user asks for (`port`, a cluster
node's firewall) is still probed here first.
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
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import requests

from eagle3_pipeline.core import paths
from eagle3_pipeline.core.errors import ServerError
from eagle3_pipeline.core.progress import log
from eagle3_pipeline.in_vllm import auth, entry_points
from eagle3_pipeline.serving.server_process import Watch, stop, tail


@dataclass
class ServerSpec:
    """What to serve and how; `extra_args` are passed to vLLM verbatim.

    Stages build it from params with `server_spec.verifier_spec`, never field by field.
    """

    model: str
    log_file: Path
    revision: str | None = None
    dtype: str | None = None  # None: vLLM's own default ("auto")
    max_model_len: int = 2048
    enforce_eager: bool = True
    tensor_parallel_size: int = 1
    reasoning_parser: str | None = None
    speculative_config: dict[str, Any] | None = None
    served_model_name: str = "verifier"
    trust_remote_code: bool = False
    # Text only: vLLM builds no vision tower and profiles no images (multimodal verifiers).
    language_model_only: bool = False
    ready_timeout_s: float = 600.0
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    # Where it listens: loopback, or a cluster node's own address (never 0.0.0.0). `port`: the
    # first port tried, then port+port_step, ... (100 tries); None: the kernel's pick at bind.
    host: str = "127.0.0.1"
    port: int | None = None
    port_step: int = 1
    # Required on every route but /health (auth.py); kept out of repr, argv and logs.
    api_key: str | None = field(default=None, repr=False)


def free_port(host: str = "127.0.0.1", first: int | None = None, step: int = 1) -> int:
    """A port free on `host`: any (first None), else the first of first, first+step, ..."""
    tries = [0] if first is None else [first + i * step for i in range(100)]
    for port in tries:
        if port > 65535:
            break
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise ServerError(
        f"no free port on {host} among {first}, {first + step}, ... (100 tried): free one or "
        "set generate.server_port to another range"
    )


def vllm_env_defaults() -> dict[str, str]:
    """Offline, workspace-local caches, a small KV cache on CPU, no usage stats: what every vLLM
    start (server, in-process engine, the CLI's own environment) gets unless the user set it."""
    return {
        "HF_HUB_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CACHE_ROOT": os.path.abspath(paths.VLLM_CACHE),
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }


def server_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment over `vllm_env_defaults`, then `extra`."""
    return vllm_env_defaults() | dict(os.environ) | (extra or {})


VLLM_SERVER_MODULE = "vllm.entrypoints.openai.api_server"


def command(spec: ServerSpec, port: int) -> list[str]:
    cmd = [
        sys.executable,
        "-m",
        entry_points.SERVER_ENTRY,
        "--run",
        VLLM_SERVER_MODULE,
        "--model",
        spec.model,
        "--served-model-name",
        spec.served_model_name,
        "--host",
        spec.host,
        "--port",
        str(port),
        "--max-model-len",
        str(spec.max_model_len),
        "--tensor-parallel-size",
        str(spec.tensor_parallel_size),
        "--disable-uvicorn-access-log",
    ]
    if spec.enforce_eager:
        cmd.append("--enforce-eager")
    if spec.reasoning_parser:
        cmd += ["--reasoning-parser", spec.reasoning_parser]
    if spec.speculative_config:
        cmd += ["--speculative-config", json.dumps(spec.speculative_config)]
    if spec.trust_remote_code:
        cmd.append("--trust-remote-code")
    if spec.language_model_only:
        cmd.append("--language-model-only")
    if spec.revision:
        cmd += ["--revision", spec.revision]
    if spec.dtype:
        cmd += ["--dtype", spec.dtype]
    if spec.api_key:  # the key itself goes through the environment (_launch)
        cmd += ["--middleware", entry_points.AUTH_MIDDLEWARE]
    return cmd + list(spec.extra_args)


def watched(cmd: list[str]) -> list[str]:
    """`cmd` run under the watchdog (server_entry._watch; see the module docstring)."""
    return [sys.executable, "-m", entry_points.SERVER_ENTRY, "--watch", "--", *cmd]


def healthy(url: str, timeout_s: float = 2.0) -> bool:
    """Whether the server at `url` answers GET /health (open without a key: auth.py)."""
    try:
        return requests.get(f"{url}/health", timeout=timeout_s).status_code == 200
    except requests.RequestException:
        return False


def listening_ports(watchdog_pid: int, host: str) -> list[int]:
    """The TCP ports the server process (the watchdog's child) listens on at `host`."""
    try:
        children = psutil.Process(watchdog_pid).children()
    except psutil.NoSuchProcess:
        return []
    ports: set[int] = set()
    for child in children:
        try:
            conns = child.net_connections(kind="tcp")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        listening = (c for c in conns if c.status == psutil.CONN_LISTEN)
        ports |= {c.laddr.port for c in listening if c.laddr.ip == host}
    return sorted(ports)


def _ready(started: Launched) -> bool:
    """Whether the server answers /health, once its port is known (one that answers /health,
    should the server process listen on more than one)."""
    if started.port is not None:
        return healthy(started.url)
    for port in listening_ports(started.proc.pid, started.spec.host):
        if healthy(f"http://{started.spec.host}:{port}"):
            started.port = port
            return True
    return False


def wait_ready(started: Launched) -> str:
    """Its base URL once the server answers /health; ServerError with its log's tail if it
    exits first or is not ready in `ready_timeout_s`."""
    spec, proc = started.spec, started.proc
    deadline = time.monotonic() + spec.ready_timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServerError(
                f"vLLM server exited with code {proc.returncode} before it was ready; see "
                f"{spec.log_file} (last lines: {tail(spec.log_file)})"
            )
        if _ready(started):
            return started.url
        time.sleep(0.25)  # a tiny model is ready a moment after it binds
    raise ServerError(
        f"vLLM server not ready after {spec.ready_timeout_s:.0f} s; see {spec.log_file} "
        "(raise vllm.ready_timeout_s in params.yaml if the model is just slow to load)"
    )


@dataclass
class Launched:
    """A server started, not yet ready; `port` None until `wait_ready` has read the kernel's."""

    proc: subprocess.Popen
    spec: ServerSpec
    port: int | None

    @property
    def url(self) -> str:
        return f"http://{self.spec.host}:{self.port}"


def launch(spec: ServerSpec) -> Launched:
    """Start the server of `spec` under the watchdog; `wait_ready` gives its URL once ready.

    The caller stops it with `stop`; `serve` and `serve_many` do both."""
    port = None if spec.port is None else free_port(spec.host, spec.port, spec.port_step)
    spec.log_file.parent.mkdir(parents=True, exist_ok=True)
    cmd = command(spec, port or 0)
    with open(spec.log_file, "w") as logf:
        logf.write("$ " + " ".join(cmd) + "\n")
        logf.flush()
        proc = subprocess.Popen(
            watched(cmd),
            stdin=subprocess.PIPE,
            stdout=logf,
            stderr=subprocess.STDOUT,
            env=server_env(spec.env) | ({auth.KEY_VAR: spec.api_key} if spec.api_key else {}),
            start_new_session=True,
        )
    where = spec.host if port is None else f"{spec.host}:{port}"
    log("vllm", f"starting server for {spec.model} on {where} (log: {spec.log_file})")
    return Launched(proc, spec, port)


@contextlib.contextmanager
def serve_many(
    specs: list[ServerSpec], on_down: Callable[[str], None] | None = None
) -> Iterator[list[str]]:
    """Start every server at once, yield their base URLs once all are ready; always stop all.
    Each is watched while it serves (`Watch`); `on_down(reason)` runs in the watch's thread
    when one stops (e.g. to interrupt work that does not ask `down_reason`).

    Start-up is mostly single-threaded imports in three processes per server, so servers that
    start together on a machine with spare cores and memory are ready in about the time of one.
    """
    previous = signal.getsignal(signal.SIGTERM)

    def on_term(signum, frame):  # a killed stage must not orphan its servers
        raise KeyboardInterrupt

    if previous in (signal.SIG_DFL, None):
        signal.signal(signal.SIGTERM, on_term)
    started: list[Launched] = []
    watches: list[Watch] = []
    try:
        t0 = time.monotonic()
        for spec in specs:
            started.append(launch(spec))
        urls = [wait_ready(s) for s in started]
        watches = [Watch(s, on_down) for s in started]
        s = "s" if len(specs) > 1 else ""
        log("vllm", f"server{s} ready in {time.monotonic() - t0:.0f} s on {', '.join(urls)}")
        yield urls
    finally:
        for watch in watches:
            watch.close()
        for server in started:
            stop(server.proc)
        if previous in (signal.SIG_DFL, None):
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


@contextlib.contextmanager
def serve(spec: ServerSpec, on_down: Callable[[str], None] | None = None) -> Iterator[str]:
    """Yield the base URL (http://127.0.0.1:PORT) of a ready server; always stop it after."""
    with serve_many([spec], on_down) as urls:
        yield urls[0]


def metrics(url: str, api_key: str | None = None) -> dict[str, float]:
    """Prometheus counters of /metrics, summed over label sets, keyed by name{labels}."""
    text = requests.get(f"{url}/metrics", headers=auth.bearer(api_key), timeout=10).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        try:
            out[name] = out.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return out


def answered(url: str, api_key: str | None = None) -> int:
    """Requests the server at `url` has finished (vLLM's request_success counter)."""
    found = metrics(url, api_key)
    return int(sum(v for k, v in found.items() if k.startswith("vllm:request_success_total")))
