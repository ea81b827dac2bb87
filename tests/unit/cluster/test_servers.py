"""cluster/servers.py's worker body without Ray (a stand-in for vLLM answering /health): it
starts the server in the driver's directory and environment, `wait` returns when the server
dies, `stop` ends it. On a real Ray cluster: tests/e2e/test_cluster_generate.py."""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path

import pytest

from eagle3_pipeline.cluster.servers import ServerWorker
from eagle3_pipeline.serving import server as vllm_server
from eagle3_pipeline.serving.server import ServerSpec

STAND_IN = """
import os, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
class H(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def log_message(self, *a):
        pass
print("threads", os.environ.get("OMP_NUM_THREADS"), "key", "VLLM_API_KEY" in os.environ,
      flush=True)
HTTPServer((sys.argv[1], int(sys.argv[2])), H).serve_forever()
"""


@pytest.fixture
def stand_in(monkeypatch) -> None:
    monkeypatch.setattr(
        vllm_server,
        "command",
        lambda spec, port: [sys.executable, "-c", STAND_IN, spec.host, str(port)],
    )


def test_the_worker_starts_waits_on_and_stops_its_server(
    tmp_path: Path, stand_in, monkeypatch
) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # what Ray sets in an actor
    cwd = os.getcwd()
    try:
        worker = ServerWorker(str(tmp_path), {"OMP_WAIT_POLICY": "PASSIVE"})
        assert os.getcwd() == str(tmp_path)
        spec = ServerSpec(model="m", log_file=Path("server-1.log"), api_key="k" * 40)
        spec.ready_timeout_s = 60
        url = worker.start(spec)
        assert url.startswith("http://127.0.0.1:")
        log = (tmp_path / "server-1.log").read_text()
        assert "threads None key True" in log  # the driver's environment, and the key
        waited: list[str] = []
        waiter = threading.Thread(target=lambda: waited.append(worker.wait()))
        waiter.start()
        os.killpg(worker.proc.pid, signal.SIGKILL)  # the server dies, its watchdog too
        waiter.join(30)
        assert len(waited) == 1 and waited[0].startswith(f"vLLM server {url} stopped: its watchdog")
        worker.stop()  # stopping a dead server is fine
    finally:
        os.chdir(cwd)


def test_a_server_that_never_gets_ready_is_stopped_and_named(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(
        vllm_server, "command", lambda spec, port: [sys.executable, "-c", "raise SystemExit(3)"]
    )
    cwd = os.getcwd()
    try:
        worker = ServerWorker(str(tmp_path), {})
        spec = ServerSpec(model="m", log_file=tmp_path / "s.log", ready_timeout_s=30)
        with pytest.raises(vllm_server.ServerError, match="exited with code 3 before it was"):
            worker.start(spec)
        assert worker.proc.poll() is not None
    finally:
        os.chdir(cwd)
