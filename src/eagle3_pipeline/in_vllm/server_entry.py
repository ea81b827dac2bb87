"""The child side of a vLLM server the pipeline starts: what runs in the server's processes.

`python -m eagle3_pipeline.in_vllm.server_entry --watch -- CMD` is the watchdog (serving/server.py
starts every server under it): it runs CMD in its process group and kills the group when its
stdin, a pipe only the stage holds, closes, so that no server outlives a SIGKILLed stage.
`python -m eagle3_pipeline.in_vllm.server_entry --run MODULE ARGS` is the server itself: vLLM's
entry point MODULE after `patch_cpu_kernel_rebind` and, where needed, `cpu_patches` (see there
why). The in-process engines (extract's, the synthesis sampler's) apply the same kernel patch.
"""

from __future__ import annotations

import contextlib
import os
import runpy
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any


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
    from eagle3_pipeline.in_vllm import cpu_patches

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
            "usage: python -m eagle3_pipeline.in_vllm.server_entry --watch -- CMD [ARGS...] | "
            "--run MODULE [ARGS...]"
        )
