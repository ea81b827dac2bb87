"""vllm_server: a server that never becomes ready is a clear error naming its log file, and no
server process outlives `serve()`: not on a failed start, not on SIGTERM to the stage, and not on
SIGKILL of the stage (the watchdog; tests/test_generate_vllm.py kills a whole stage).

Processes are found by a tag in their environment, so other people's vLLM servers on this machine
never count and ours are found even after they were re-parented.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from server_procs import TAG_VAR, tagged_pids, wait_none_tagged  # noqa: E402

from eagle3_pipeline.errors import ServerError
from eagle3_pipeline.serving.server import ServerSpec, serve, watched


def _spec(tmp_path: Path, model: Path, tag: str, **kw) -> ServerSpec:
    return ServerSpec(
        model=str(model), log_file=tmp_path / "logs" / "server.log", env={TAG_VAR: tag}, **kw
    )


# ---------------------------------------------------------------------------------------------
# the watchdog, with a stand-in for vLLM


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


# ---------------------------------------------------------------------------------------------
# real vLLM


@pytest.mark.vllm
def test_server_that_exits_names_its_log_file(tmp_path: Path) -> None:
    tag = uuid.uuid4().hex
    spec = _spec(tmp_path, tmp_path / "no-such-model", tag, ready_timeout_s=300)
    with pytest.raises(ServerError) as info, serve(spec):
        pytest.fail("a server for a missing model became ready")
    message = str(info.value)
    assert "exited with code" in message and f"see {spec.log_file}" in message
    assert "\n" not in message
    assert wait_none_tagged(tag) == []


@pytest.mark.vllm
def test_server_not_ready_in_time_names_its_log_file_and_is_stopped(tmp_path: Path) -> None:
    tag = uuid.uuid4().hex
    spec = _spec(tmp_path, tmp_path / "no-such-model", tag, ready_timeout_s=1.0)
    t0 = time.monotonic()
    with (
        pytest.raises(ServerError, match=rf"not ready after 1 s; see {spec.log_file}"),
        serve(spec),
    ):
        pytest.fail("ready in 1 s")
    assert time.monotonic() - t0 < 40
    assert wait_none_tagged(tag) == []


STAGE_SCRIPT = """
import sys, time
from pathlib import Path
from eagle3_pipeline.serving.server import ServerSpec, serve
spec = ServerSpec(model=sys.argv[1], log_file=Path(sys.argv[2]), ready_timeout_s=600)
with serve(spec) as url:
    print("READY", url, flush=True)
    time.sleep(600)
"""


@pytest.mark.vllm
def test_sigterm_to_a_stage_stops_its_ready_server(tmp_path: Path, tiny_verifier_dir: Path) -> None:
    tag = uuid.uuid4().hex
    log = tmp_path / "server.log"
    stage = subprocess.Popen(
        [sys.executable, "-c", STAGE_SCRIPT, str(tiny_verifier_dir), str(log)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=os.environ | {TAG_VAR: tag},
    )
    try:
        lines = []
        for line in stage.stdout:
            lines.append(line)
            if line.startswith("READY"):
                break
        assert lines and lines[-1].startswith("READY"), "".join(lines) + log.read_text()[-2000:]
        assert len(tagged_pids(tag)) >= 4  # stage, watchdog, API server, engine core
        stage.send_signal(signal.SIGTERM)
        assert stage.wait(timeout=60) != 0
        assert wait_none_tagged(tag) == []
    finally:
        if stage.poll() is None:
            stage.kill()
            stage.wait()


def test_kernel_rebind_scan_skips_objects_whose_lookup_raises() -> None:
    """vLLM's CPU kernel scan visits every module global: a proxy that raises on lookup
    (werkzeug's, once moto/flask is imported) or a non-mapping __dict__ (llvmlite) is skipped."""
    from vllm.triton_utils import dispatcher

    from eagle3_pipeline.serving.server import patch_cpu_kernel_rebind

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
