"""serving/server.py's port: the server binds port 0 itself and `wait_ready` reads the kernel's
pick from its listening sockets, the one that answers /health where there are several. Against
a real vLLM server: tests/integration/test_generate_vllm.py (every server the suite starts)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from eagle3_pipeline.serving import server as vllm_server
from eagle3_pipeline.serving.server import ServerSpec

# Listens on a raw socket first (as vLLM's API server may, e.g. for ZMQ), then serves /health on
# the port it was given (0: the kernel's pick) and prints both.
STAND_IN = """
import socket, sys, threading, time
from http.server import BaseHTTPRequestHandler, HTTPServer
raw = socket.socket(); raw.bind((sys.argv[1], 0)); raw.listen()
def hang_up():  # no HTTP here: a probe fails at once instead of timing out
    while True:
        raw.accept()[0].close()
threading.Thread(target=hang_up, daemon=True).start()
class H(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404); self.end_headers()
    def log_message(self, *a):
        pass
time.sleep(1.5)  # imports: the port is known before the server is ready
httpd = HTTPServer((sys.argv[1], int(sys.argv[2])), H)
print("raw", raw.getsockname()[1], "http", httpd.server_address[1], flush=True)
httpd.serve_forever()
"""


@pytest.fixture
def commands(monkeypatch) -> list[list[str]]:
    given: list[list[str]] = []
    vllm_command = vllm_server.command

    def command(spec: ServerSpec, port: int) -> list[str]:
        given.append(vllm_command(spec, port))
        return [sys.executable, "-c", STAND_IN, spec.host, str(port)]

    monkeypatch.setattr(vllm_server, "command", command)
    return given


def test_the_kernel_picks_the_port_and_the_health_answering_one_is_the_url(
    tmp_path: Path, commands
) -> None:
    spec = ServerSpec(model="m", log_file=tmp_path / "server.log", ready_timeout_s=60)
    with vllm_server.serve(spec) as url:
        raw, http = [int(w) for w in (tmp_path / "server.log").read_text().split()[-3::2]]
        assert url == f"http://127.0.0.1:{http}" and raw != http
        assert vllm_server.healthy(url)
    cmd = commands[0]
    assert cmd[cmd.index("--port") + 1] == "0"


def test_a_port_range_asked_for_is_still_probed(tmp_path: Path, commands) -> None:
    first = vllm_server.free_port()
    spec = ServerSpec(model="m", log_file=tmp_path / "server.log", port=first, port_step=7)
    spec.ready_timeout_s = 60
    with vllm_server.serve(spec) as url:
        port = int(url.rpartition(":")[2])
        assert (port - first) % 7 == 0
    cmd = commands[0]
    assert cmd[cmd.index("--port") + 1] == str(port)
