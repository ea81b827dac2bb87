"""Start, wait for and always stop a vLLM OpenAI-compatible server.

The server runs in its own process group on loopback (or the address `host` names: a cluster
node's own address) with a free port, logs to a file, and is stopped (SIGTERM, then SIGKILL)
and reaped when the `with` block ends for any reason, including Ctrl-C and SIGTERM sent to the
stage. A SIGKILLed stage runs no cleanup at all, so the server is
started under a small watchdog (`python -m eagle3_pipeline.serving.server --watch -- CMD`)
that kills the group when its stdin, a pipe only the stage holds, closes: no server is ever left
behind.
The server itself is started through `python -m eagle3_pipeline.serving.server --run MODULE`, which
applies `patch_cpu_kernel_rebind` and, where needed, `cpu_patches` before vLLM's own entry point
runs (see there why). With `api_key`, every route but /health wants that key (auth.py); the key
reaches the server through its environment only, never its command line or log.
"""

from __future__ import annotations

import contextlib
import json
import os
import runpy
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests

from eagle3_pipeline.core import paths
from eagle3_pipeline.core.errors import ServerError
from eagle3_pipeline.core.progress import log
from eagle3_pipeline.serving import auth


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
    # first port tried, then port+port_step, ... (100 tries); None: any free port.
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


def patch_cpu_kernel_rebind() -> None:
    """Let vLLM 0.32 on CPU start when numba has been imported (Kimi-K2.5's image processor).

    Without Triton, vLLM's CPU platform rebinds kernels by scanning every module namespace and
    calling `vars(value).get(...)` on each value with a `__dict__`. llvmlite (imported with
    numba) has an object whose `__dict__` is a ctypes function wrapper, so engine start fails
    with `AttributeError: '_lib_fn_wrapper' object has no attribute 'get'`. The scan is made to
    skip values whose `__dict__` is no mapping, and values whose attribute lookup raises
    (e.g. werkzeug's context proxies, imported with moto/flask: `hasattr` raises RuntimeError
    outside an app context); nothing else changes. On GPU (Triton present) the scan never runs.
    """
    import builtins
    from collections.abc import Mapping

    from vllm.triton_utils import dispatcher

    if getattr(dispatcher, "vars", None) is not None:  # already patched
        return

    def mapping_vars(obj: Any) -> Mapping:
        try:
            found = builtins.vars(obj)
        except Exception:  # noqa: BLE001 - any object the scan cannot read is skipped
            return {}
        return found if isinstance(found, Mapping) else {}

    def safe_hasattr(obj: Any, name: str) -> bool:
        try:
            return builtins.hasattr(obj, name)
        except Exception:  # noqa: BLE001
            return False

    # Module globals shadow the builtins inside the scan only.
    dispatcher.vars = mapping_vars
    dispatcher.hasattr = safe_hasattr


def command(spec: ServerSpec, port: int) -> list[str]:
    cmd = [
        sys.executable,
        "-m",
        "eagle3_pipeline.serving.server",
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
        cmd += ["--middleware", auth.MIDDLEWARE]
    return cmd + list(spec.extra_args)


def watched(cmd: list[str]) -> list[str]:
    """`cmd` run under the watchdog of `_watch` (see the module docstring)."""
    return [sys.executable, "-m", "eagle3_pipeline.serving.server", "--watch", "--", *cmd]


def _sweep_on_eof(orphaned: threading.Event, grace_s: float = 20.0) -> None:
    # Raw reads until EOF, when the stage holding the other end is gone. (Not sys.stdin: a daemon
    # thread blocked on its buffer lock aborts the interpreter at exit.)
    while os.read(0, 1024):
        pass
    orphaned.set()
    with contextlib.suppress(ProcessLookupError):
        os.killpg(0, signal.SIGTERM)
    time.sleep(grace_s)
    os.killpg(0, signal.SIGKILL)  # a server deaf to SIGTERM, this watchdog included


def _die_with_watchdog(watchdog_pid: int) -> None:
    """In the server's process: SIGTERM when the watchdog dies, however it dies (a Ray worker's
    exit SIGKILLs the worker's children, the watchdog among them, before it can sweep). SIGTERM,
    not SIGKILL: vLLM then ends its EngineCore and workers itself (measured: all gone within
    8 s); a SIGKILLed API server leaves them running. A watchdog that died between the fork and
    the prctl sends nothing: then the server ends before it starts (SIGKILL: until the exec this
    process still has the watchdog's SIGTERM handler)."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() != watchdog_pid:
        os.kill(os.getpid(), signal.SIGKILL)


def _watch(cmd: list[str]) -> int:
    """Run `cmd` in this process group; kill the group when stdin closes. Exit with its code."""
    # A handler, not SIG_IGN: ignored signals stay ignored across exec, handlers do not. The
    # group's SIGTERM is meant for vLLM; this process exits when vLLM does.
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    watchdog = os.getpid()
    child = subprocess.Popen(
        cmd, stdin=subprocess.DEVNULL, preexec_fn=lambda: _die_with_watchdog(watchdog)
    )
    orphaned = threading.Event()
    threading.Thread(target=_sweep_on_eof, args=(orphaned,), daemon=True).start()
    code = child.wait()
    if orphaned.is_set():  # no stage is left to sweep the group after the server: do it here
        os.killpg(0, signal.SIGKILL)
    return code if code >= 0 else 128 - code  # killed by signal N: exit 128+N, as a shell says


def stop(proc: subprocess.Popen, grace_s: float = 20.0) -> None:
    """SIGTERM the whole process group (vLLM forks workers), then SIGKILL, and reap."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    # Workers that outlived the leader are still in the group.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    if proc.stdin is not None:
        proc.stdin.close()


def _tail(path: Path, n: int = 5) -> str:
    try:
        lines = [x for x in path.read_text(errors="replace").splitlines() if x.strip()]
    except OSError:
        return ""
    return " | ".join(lines[-n:])


def healthy(url: str, timeout_s: float = 2.0) -> bool:
    """Whether the server at `url` answers GET /health (open without a key: auth.py)."""
    try:
        return requests.get(f"{url}/health", timeout=timeout_s).status_code == 200
    except requests.RequestException:
        return False


def wait_ready(url: str, proc: subprocess.Popen | None, spec: ServerSpec) -> None:
    deadline = time.monotonic() + spec.ready_timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise ServerError(
                f"vLLM server exited with code {proc.returncode} before it was ready; see "
                f"{spec.log_file} (last lines: {_tail(spec.log_file)})"
            )
        if healthy(url):
            return
        time.sleep(1.0)
    raise ServerError(
        f"vLLM server not ready after {spec.ready_timeout_s:.0f} s; see {spec.log_file} "
        "(raise vllm.ready_timeout_s in params.yaml if the model is just slow to load)"
    )


def launch(spec: ServerSpec) -> tuple[subprocess.Popen, str]:
    """Start the server of `spec` under the watchdog; (process, base URL), not yet ready.

    The caller stops it with `stop`; `serve` and `serve_many` do both."""
    port = free_port(spec.host, spec.port, spec.port_step)
    spec.log_file.parent.mkdir(parents=True, exist_ok=True)
    cmd = command(spec, port)
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
    url = f"http://{spec.host}:{port}"
    log("vllm", f"starting server for {spec.model} on {url} (log: {spec.log_file})")
    return proc, url


@contextlib.contextmanager
def serve_many(specs: list[ServerSpec]) -> Iterator[list[str]]:
    """Start every server at once, yield their base URLs once all are ready; always stop all.

    Start-up is mostly single-threaded imports in three processes per server, so servers that
    start together on a machine with spare cores and memory are ready in about the time of one.
    """
    previous = signal.getsignal(signal.SIGTERM)

    def on_term(signum, frame):  # a killed stage must not orphan its servers
        raise KeyboardInterrupt

    if previous in (signal.SIG_DFL, None):
        signal.signal(signal.SIGTERM, on_term)
    started: list[subprocess.Popen] = []
    try:
        t0 = time.monotonic()
        urls = []
        for spec in specs:
            proc, url = launch(spec)
            started.append(proc)
            urls.append(url)
        for spec, proc, url in zip(specs, started, urls, strict=True):
            wait_ready(url, proc, spec)
        log("vllm", f"server{'s' if len(specs) > 1 else ''} ready in {time.monotonic() - t0:.0f} s")
        yield urls
    finally:
        for proc in started:
            stop(proc)
        if previous in (signal.SIG_DFL, None):
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


@contextlib.contextmanager
def serve(spec: ServerSpec) -> Iterator[str]:
    """Yield the base URL (http://127.0.0.1:PORT) of a ready server; always stop it after."""
    with serve_many([spec]) as urls:
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


def _fork_engine_core() -> None:
    """Start the engine core by fork, not spawn, on CPU with the uni executor: the core is then
    this process's only child, and it skips a second import of torch and vLLM (16 of a server's
    38 s of start-up on 2 cores). vLLM's CPU platform sets spawn for its workers
    (`CpuPlatform.check_and_update_config`); with the uni executor there is none, and the API
    server has run no model code (no OpenMP thread team) when it forks. vLLM still spawns where
    it must (`_maybe_force_spawn`); VLLM_WORKER_MULTIPROC_METHOD set by the user wins."""
    from vllm.platforms import cpu

    method = os.environ.get("VLLM_WORKER_MULTIPROC_METHOD", "fork")
    update = cpu.CpuPlatform.check_and_update_config.__func__

    def check_and_update_config(cls, vllm_config) -> None:  # noqa: ANN001 - vLLM's signature
        update(cls, vllm_config)
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = method

    cpu.CpuPlatform.check_and_update_config = classmethod(check_and_update_config)


MULTIPROCESSING_VAR = "VLLM_ENABLE_V1_MULTIPROCESSING"


def cpu_worker_in_engine_core(env: Mapping[str, str]) -> bool:
    """Whether a CPU server started with `env` runs its worker inside the engine core process
    (the uni executor): unless the user sets VLLM_ENABLE_V1_MULTIPROCESSING to anything but 0."""
    return env.get(MULTIPROCESSING_VAR, "0") == "0"


def _run_vllm(module: str, args: list[str]) -> None:
    """vLLM's entry point `module` with `args`, after the CPU patches: the kernel rebind (the
    scan runs in this process) and, only for an MLA verifier with a drafter on CPU, the
    block-size pairing of `cpu_patches` (which also reaches the engine's worker). On CPU the
    worker runs inside the engine core process (VLLM_ENABLE_V1_MULTIPROCESSING=0 unless set),
    that process is forked (`_fork_engine_core`), and model classes are inspected in this
    process (`cpu_patches.inspect_models_in_process`)."""
    from eagle3_pipeline.serving import cpu_patches

    if cpu_patches.on_cpu_platform():
        # With multiprocessing on, vLLM's CPU platform forces the mp executor: the API server,
        # the engine core and its worker start one after another, each importing torch and
        # vLLM. Off, it keeps the uni executor (the worker inside the engine core, still a
        # process of its own, which is then forked, not spawned: one import of torch and vLLM
        # in all instead of three). A value the user set wins.
        os.environ.setdefault(MULTIPROCESSING_VAR, "0")
        if cpu_worker_in_engine_core(os.environ):
            _fork_engine_core()
        cpu_patches.inspect_models_in_process()
    patch_cpu_kernel_rebind()
    args = cpu_patches.server_args_with_patches(args)
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--run"] and len(sys.argv) >= 3:
        _run_vllm(sys.argv[2], sys.argv[3:])
    elif sys.argv[1:3] == ["--watch", "--"] and len(sys.argv) >= 4:
        sys.exit(_watch(sys.argv[3:]))
    else:
        sys.exit(
            "usage: python -m eagle3_pipeline.serving.server --watch -- CMD [ARGS...] | "
            "--run MODULE [ARGS...]"
        )
