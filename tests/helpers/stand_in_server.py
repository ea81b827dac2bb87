"""A stand-in for a vLLM server, for tests of what the stage does when its server stops: the
same process tree as vLLM's on CPU (the watchdog, an API server, an engine process it forked),
/health and /v1/models answered, and chat requests that never finish (requests in flight when
the server stops). `mode` "sick": /health answers 503 once a chat request has arrived."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import psutil

from eagle3_pipeline.serving import server as vllm_server
from eagle3_pipeline.serving.server import ServerSpec

SCRIPT = """
import json, os, signal, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
host, port, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
if os.fork() == 0:  # the engine process
    import ctypes
    libc = ctypes.CDLL(None)
    libc.prctl(1, signal.SIGKILL)  # dies with the API server, as vLLM's does
    libc.prctl(15, b"VLLM::EngineCore")  # PR_SET_NAME: named as vLLM names it
    while True:
        time.sleep(60)
asked = []
MODELS = {"object": "list", "data": [{"id": "verifier", "object": "model", "created": 0,
                                      "owned_by": "stand-in"}]}
class H(BaseHTTPRequestHandler):
    def answer(self, code, body=b""):
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def do_GET(self):
        if self.path == "/health":
            self.answer(503 if mode == "sick" and asked else 200)
        elif self.path == "/v1/models":
            self.answer(200, json.dumps(MODELS).encode())
        else:
            self.answer(404)
    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        asked.append(self.path)
        # One write per line: two requests in flight must not interleave their words.
        sys.stdout.write(f"stand-in: asked {self.path}\\n")
        sys.stdout.flush()
        time.sleep(3600)
    def log_message(self, *a):
        pass
httpd = ThreadingHTTPServer((host, port), H)
httpd.daemon_threads = True
sys.stdout.write(f"stand-in: serving {httpd.server_address[1]}\\n")
sys.stdout.flush()
httpd.serve_forever()
"""


def use_stand_in(monkeypatch, mode: str = "healthy") -> None:
    """Every server `serving/server.py` starts is the stand-in (`mode`: healthy or sick)."""
    monkeypatch.setattr(
        vllm_server,
        "command",
        lambda spec, port: [sys.executable, "-c", SCRIPT, spec.host, str(port), mode],
    )


def spec(tmp: Path) -> ServerSpec:
    return ServerSpec(model="m", log_file=tmp / "server.log", ready_timeout_s=60)


def processes(url: str) -> dict[str, psutil.Process]:
    """The stand-in's watchdog, API server and engine, found by the port it listens on."""
    port = int(url.rpartition(":")[2])
    for proc in psutil.process_iter():
        try:
            listening = [c for c in proc.net_connections("tcp") if c.status == "LISTEN"]
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if any(c.laddr.port == port for c in listening) and proc.children():
            return {"watchdog": proc.parent(), "api": proc, "engine": proc.children()[0]}
    raise AssertionError(f"no stand-in listens on {port}")


def server_url(log_file: Path) -> str:
    """The stand-in's URL, from the port it printed to its log."""
    return f"http://127.0.0.1:{_said(log_file, 'serving')[0].split()[2]}"


def _said(log_file: Path, what: str) -> list[str]:
    """The stand-in's own lines saying `what` (not its command line, which the log starts with)."""
    if not log_file.is_file():
        return []
    return [x for x in log_file.read_text().splitlines() if x.startswith(f"stand-in: {what}")]


def wait_asked(log_file: Path, timeout_s: float = 30.0) -> None:
    """Until the stand-in has received a chat request (it says so in its log)."""
    deadline = time.monotonic() + timeout_s
    while not _said(log_file, "asked"):
        assert time.monotonic() < deadline, "no request reached the stand-in"
        time.sleep(0.05)


def kill(url: str, which: str) -> None:
    """SIGKILL the stand-in's `which`: watchdog, api or engine."""
    os.kill(processes(url)[which].pid, signal.SIGKILL)
