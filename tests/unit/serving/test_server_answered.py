"""serving/server.py's counters from a server's /metrics: summed over label sets, read with the
run's key (the servers the pipeline starts refuse /metrics without it)."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import requests

from eagle3_pipeline.serving import server

METRICS = b"""# HELP vllm:request_success_total Count of successfully processed requests.
# TYPE vllm:request_success_total counter
vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 3.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 4.0
vllm:num_requests_running{engine="0",model_name="m"} 1.0
"""


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        ok = self.headers.get("Authorization") == "Bearer k1"
        self.send_response(200 if ok else 401)
        self.end_headers()
        self.wfile.write(METRICS if ok else b"{}")


@pytest.fixture
def url():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_answered_sums_every_finish_reason_with_the_key(url: str) -> None:
    assert server.answered(url, "k1") == 7
    assert server.metrics(url, "k1")['vllm:num_requests_running{engine="0",model_name="m"}'] == 1
    assert server.answered(url) == 0  # refused without the key: nothing counted
    with pytest.raises(requests.ConnectionError):
        server.answered("http://127.0.0.1:9")
