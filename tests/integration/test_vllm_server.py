"""vllm_server: a server that never becomes ready is a clear error naming its log file, and no
server process outlives `serve()`: not on a failed start, and not on SIGTERM to the stage (the
watchdog with a stand-in for vLLM: tests/unit/in_vllm/test_server_entry.py; SIGKILL of a whole
stage: tests/integration/test_generate_vllm.py).

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
from server_procs import TAG_VAR, tagged_pids, wait_none_tagged

from eagle3_pipeline.core.errors import ServerError
from eagle3_pipeline.serving.server import ServerSpec, serve


def _spec(tmp_path: Path, model: Path, tag: str, **kw) -> ServerSpec:
    return ServerSpec(
        model=str(model), log_file=tmp_path / "logs" / "server.log", env={TAG_VAR: tag}, **kw
    )


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
