"""in_vllm.server_entry: the watchdog (with a stand-in for vLLM) ends the server's process group
when the stage disappears and passes SIGTERM on; the CPU kernel-rebind scan skips objects it cannot
read. Servers that start real vLLM: tests/integration/test_vllm_server.py.

Processes are found by a tag in their environment, so other people's processes on this machine
never count and ours are found even after they were re-parented.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid

import pytest
from server_procs import TAG_VAR, tagged_pids, wait_none_tagged

from eagle3_pipeline.serving.server import watched


def _watchdog(tag: str, code: str) -> subprocess.Popen:
    cmd = watched([sys.executable, "-c", code])
    return subprocess.Popen(
        cmd, stdin=subprocess.PIPE, env=os.environ | {TAG_VAR: tag}, start_new_session=True
    )


def test_watchdog_kills_the_group_when_the_stage_disappears() -> None:
    tag = uuid.uuid4().hex
    proc = _watchdog(tag, "import time; time.sleep(600)")
    deadline = time.monotonic() + 30
    while len(tagged_pids(tag)) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(tagged_pids(tag)) == 2  # watchdog + "server"
    proc.stdin.close()  # what the kernel does when a SIGKILLed stage's pipe end goes away
    assert proc.wait(timeout=30) == -signal.SIGKILL
    assert wait_none_tagged(tag, 10) == []


def test_watchdog_passes_sigterm_on_and_exits_with_the_server() -> None:
    tag = uuid.uuid4().hex
    proc = _watchdog(tag, "import time; time.sleep(600)")
    time.sleep(1.0)
    os.killpg(proc.pid, signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    proc.stdin.close()
    assert wait_none_tagged(tag, 10) == []


def test_watchdog_exits_with_the_server_code() -> None:
    proc = _watchdog(uuid.uuid4().hex, "raise SystemExit(3)")
    assert proc.wait(timeout=30) == 3
    proc.stdin.close()


@pytest.mark.parametrize(("parent_is_the_watchdog", "code"), [(True, 0), (False, -signal.SIGKILL)])
def test_a_server_whose_watchdog_died_before_it_was_armed_ends(
    parent_is_the_watchdog: bool, code: int
) -> None:
    """A watchdog killed between the fork and the prctl arms no death signal: the server, no
    longer the watchdog's child, ends itself before it runs, through the SIGTERM handler that
    it inherits from the watchdog until its exec."""
    from eagle3_pipeline.in_vllm import server_entry as srv

    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)  # as _watch sets it
    try:
        watchdog = os.getpid() if parent_is_the_watchdog else os.getpid() + 10**7  # reparented
        proc = subprocess.Popen(
            [sys.executable, "-c", "pass"], preexec_fn=lambda: srv._die_with_watchdog(watchdog)
        )
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert proc.wait(timeout=30) == code


def test_kernel_rebind_scan_skips_objects_whose_lookup_raises() -> None:
    """vLLM's CPU kernel scan visits every module global: a proxy that raises on lookup
    (werkzeug's, once moto/flask is imported) or a non-mapping __dict__ (llvmlite) is skipped."""
    from vllm.triton_utils import dispatcher

    from eagle3_pipeline.in_vllm.server_entry import patch_cpu_kernel_rebind

    class Raises:
        def __getattribute__(self, name: str):
            raise RuntimeError("Working outside of application context.")

    class OddDict:
        pass

    odd = OddDict()
    object.__setattr__(odd, "__dict__", {})
    patch_cpu_kernel_rebind()
    assert dispatcher.hasattr(Raises(), "__dict__") is False
    assert dict(dispatcher.vars(Raises())) == {}
    assert dispatcher.hasattr(odd, "__dict__") is True


@pytest.mark.parametrize(
    ("on_cpu", "preset", "expected"),
    [(True, None, "0"), (True, "1", "1"), (False, None, None)],
)
def test_a_cpu_server_runs_its_worker_in_the_engine_process_unless_the_user_says(
    monkeypatch: pytest.MonkeyPatch, on_cpu: bool, preset: str | None, expected: str | None
) -> None:
    """On CPU the server's worker runs inside its engine core process (one process and one
    import less at every start); a value the user set, and any accelerator platform, are left
    as they are."""
    from eagle3_pipeline.in_vllm import cpu_patches
    from eagle3_pipeline.in_vllm import server_entry as srv

    var = "VLLM_ENABLE_V1_MULTIPROCESSING"
    monkeypatch.setenv(var, preset or "")  # restored (or removed) after the test either way
    if preset is None:
        monkeypatch.delenv(var)
    ran: list[tuple[str, list[str]]] = []
    monkeypatch.setattr(cpu_patches, "on_cpu_platform", lambda: on_cpu)
    monkeypatch.setattr(srv, "patch_cpu_kernel_rebind", lambda: None)
    monkeypatch.setattr(cpu_patches, "server_args_with_patches", lambda args: args)
    monkeypatch.setattr(cpu_patches, "inspect_models_in_process", lambda: None)
    monkeypatch.setattr(srv.runpy, "run_module", lambda m, **kw: ran.append((m, sys.argv[1:])))
    forked: list[bool] = []
    monkeypatch.setattr(srv, "_fork_engine_core", lambda: forked.append(True))
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    srv._run_vllm("vllm.entrypoints.openai.api_server", ["--model", "m"])
    assert ran == [("vllm.entrypoints.openai.api_server", ["--model", "m"])]
    assert os.environ.get(var) == expected
    assert forked == ([True] if expected == "0" else [])  # fork needs the uni executor


@pytest.mark.parametrize(
    ("multiprocessing", "preset", "expected"),
    [("0", None, "fork"), ("0", "spawn", "spawn"), ("1", None, "spawn")],
)
def test_a_cpu_server_forks_its_engine_core_only_with_the_uni_executor(
    monkeypatch: pytest.MonkeyPatch, multiprocessing: str, preset: str | None, expected: str
) -> None:
    """vLLM's CPU platform asks for spawn; with the uni executor the engine core (the server's
    only child) is forked instead, unless the user chose a method; with the mp executor (whose
    workers come from the engine core) vLLM's spawn stands."""
    from vllm.platforms import cpu

    from eagle3_pipeline.in_vllm import cpu_patches
    from eagle3_pipeline.in_vllm import server_entry as srv

    method = "VLLM_WORKER_MULTIPROC_METHOD"
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", multiprocessing)
    monkeypatch.setenv(method, preset or "")
    if preset is None:
        monkeypatch.delenv(method)

    def vllm_s_own(cls, vllm_config) -> None:  # noqa: ANN001 - what the platform does to it
        os.environ[method] = "spawn"

    monkeypatch.setattr(cpu.CpuPlatform, "check_and_update_config", classmethod(vllm_s_own))
    monkeypatch.setattr(cpu_patches, "on_cpu_platform", lambda: True)
    monkeypatch.setattr(srv, "patch_cpu_kernel_rebind", lambda: None)
    monkeypatch.setattr(cpu_patches, "server_args_with_patches", lambda args: args)
    monkeypatch.setattr(cpu_patches, "inspect_models_in_process", lambda: None)
    monkeypatch.setattr(srv.runpy, "run_module", lambda m, **kw: None)
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    srv._run_vllm("vllm.entrypoints.openai.api_server", ["--model", "m"])
    cpu.CpuPlatform.check_and_update_config(object())  # as vLLM calls it, building its config
    assert os.environ[method] == expected
