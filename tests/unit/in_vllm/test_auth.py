"""in_vllm/auth.py and the keyed server start: every route but /health wants the key (vLLM's own
--api-key leaves /invocations, /metrics and more open); the key reaches the server through its
environment, never its command line, its log or a repr. A real keyed vLLM server:
tests/e2e/test_cluster_generate.py."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
from pathlib import Path

import pytest

from eagle3_pipeline.in_vllm import auth, entry_points
from eagle3_pipeline.serving import server as vllm_server
from eagle3_pipeline.serving.server import ServerSpec

KEY = "k" * 43


def _call(path: str, headers: dict[str, str], method: str = "GET") -> int:
    """The status the middleware answers (200: passed on to the app)."""
    sent: list[dict] = []

    async def app(scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})

    async def send(message: dict) -> None:
        sent.append(message)

    async def receive() -> dict:
        return {"type": "http.request", "body": b""}

    scope = {
        "type": "http",
        "method": method,
        "path": path,
        "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
    }
    asyncio.run(auth.RequireKey(app)(scope, receive, send))
    return sent[0]["status"]


def test_every_route_but_health_wants_the_key(monkeypatch) -> None:
    monkeypatch.setenv(auth.KEY_VAR, KEY)
    good = auth.bearer(KEY)
    for path in ("/v1/chat/completions", "/invocations", "/metrics", "/tokenize", "/v1/models"):
        assert _call(path, {}) == 401, path
        assert _call(path, {"Authorization": "Bearer nope"}) == 401, path
        assert _call(path, {"Authorization": f"Basic {KEY}"}) == 401, path
        assert _call(path, good) == 200, path
    assert _call("/health", {}) == 200  # readiness only
    assert _call("/v1/models", {}, method="OPTIONS") == 200


def test_the_middleware_refuses_to_run_without_a_key(monkeypatch) -> None:
    monkeypatch.delenv(auth.KEY_VAR, raising=False)
    with pytest.raises(RuntimeError, match="needs VLLM_API_KEY"):
        auth.RequireKey(lambda *a: None)


def test_a_keyed_server_gets_its_key_by_environment_only(tmp_path: Path, monkeypatch) -> None:
    started: dict = {}

    class FakePopen:
        pid = 1

        def __init__(self, cmd, env, **kw) -> None:
            started["cmd"], started["env"] = cmd, env

    monkeypatch.setattr(subprocess, "Popen", FakePopen)
    spec = ServerSpec(
        model="m", log_file=tmp_path / "server.log", host="127.0.0.1", api_key=KEY, port=None
    )
    launched = vllm_server.launch(spec)
    assert launched.port is None  # the kernel picks it at vLLM's bind (--port 0)
    cmd = " ".join(started["cmd"])
    assert "--port 0" in cmd
    assert KEY not in cmd and "--api-key" not in cmd
    assert f"--middleware {entry_points.AUTH_MIDDLEWARE}" in cmd and "--host 127.0.0.1" in cmd
    assert started["env"][auth.KEY_VAR] == KEY
    assert KEY not in (tmp_path / "server.log").read_text()  # the log starts with the command
    assert KEY not in repr(spec)


def test_an_unkeyed_server_is_started_as_before(tmp_path: Path) -> None:
    cmd = vllm_server.command(ServerSpec(model="m", log_file=tmp_path / "log"), 8000)
    assert "--middleware" not in cmd and cmd[cmd.index("--host") + 1] == "127.0.0.1"


def test_free_port_tries_its_range_in_steps() -> None:
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        # The next step, not necessarily taken + 3: a server another test started at the same
        # time may hold that one (CI saw 42646 taken beside 42643).
        port = vllm_server.free_port("127.0.0.1", taken, 3)
        assert port > taken and (port - taken) % 3 == 0, (taken, port)
    assert vllm_server.free_port("127.0.0.1", taken, 3) == taken


def _running(pids: set[int], needle: str) -> int | None:
    """The first of `pids` whose command line (after its exec) contains `needle`."""
    for pid in pids:
        with contextlib.suppress(OSError):
            if needle.encode() in (Path("/proc") / str(pid) / "cmdline").read_bytes():
                return pid
    return None


def test_the_server_dies_with_its_watchdog_however_the_watchdog_dies() -> None:
    """Ray SIGKILLs a dead worker's children (the watchdog) before the watchdog can sweep its
    group: the server must not be orphaned then."""
    import os
    import signal
    import sys
    import time
    import uuid

    from server_procs import TAG_VAR, tagged_pids, wait_none_tagged

    tag = uuid.uuid4().hex
    proc = subprocess.Popen(
        vllm_server.watched([sys.executable, "-c", "import time; time.sleep(600)"]),
        stdin=subprocess.PIPE,
        env=os.environ | {TAG_VAR: tag},
        start_new_session=True,
    )
    # Until the server runs its own command: between the fork and the exec the kernel may show
    # its environment empty for a moment, and a killed watchdog's signal is not armed yet.
    deadline = time.monotonic() + 30
    while not (server := _running(set(tagged_pids(tag)) - {proc.pid}, "time.sleep(600)")):
        assert time.monotonic() < deadline, f"no server within 30 s: {tagged_pids(tag)}"
        time.sleep(0.1)
    assert set(tagged_pids(tag)) == {proc.pid, server}
    os.kill(proc.pid, signal.SIGKILL)  # the watchdog alone, not its group
    proc.wait()
    assert wait_none_tagged(tag, 10) == []
