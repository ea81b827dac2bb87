"""A scripted OpenAI-like chat server on 127.0.0.1, for the chat client and the stages using it.

Each POST is answered by `respond(body)`: (status, json) or (status, json, headers), or DROP to
hang up without a response.
GET (any path: /v1/models, /metrics) answers the model list with `models_status`.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

DROP = "drop"  # a fake answer that closes the connection without a response
Respond = Callable[[dict[str, Any]], Any]


def row_id(body: dict[str, Any]) -> str:
    """The id the tests put as the last word of the first message."""
    return body["messages"][0]["content"].split()[-1]


class FakeServer:
    """Records every POST body and the most requests it had in flight at once."""

    def __init__(self, respond: Respond) -> None:
        self.respond = respond
        self.models_status = 200  # what GET /v1/models answers
        self.bodies: list[dict[str, Any]] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self._lock = threading.Lock()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.httpd.daemon_threads = True
        self.httpd.handle_error = lambda request, address: None  # a client that gave up
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, status: int, payload: Any, headers: dict | None = None) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                for name, value in (headers or {}).items():
                    self.send_header(name, value)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                self._send(fake.models_status, {"object": "list", "data": [{"id": "verifier"}]})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with fake._lock:
                    fake.bodies.append(body)
                    fake.in_flight += 1
                    fake.max_in_flight = max(fake.max_in_flight, fake.in_flight)
                try:
                    answer = fake.respond(body)
                finally:
                    with fake._lock:
                        fake.in_flight -= 1
                if answer == DROP:
                    self.close_connection = True
                    return
                self._send(*answer)

        return Handler

    def requested_ids(self) -> list[str]:
        return [row_id(b) for b in self.bodies]


@contextlib.contextmanager
def fake_servers() -> Iterator[Callable[[Respond], FakeServer]]:
    """`start(respond)` starts a server; every one started is shut down on exit."""
    servers: list[FakeServer] = []

    def start(respond: Respond) -> FakeServer:
        server = FakeServer(respond)
        threading.Thread(target=server.httpd.serve_forever, args=(0.05,), daemon=True).start()
        servers.append(server)
        return server

    try:
        yield start
    finally:
        for server in servers:
            server.httpd.shutdown()
            server.httpd.server_close()


def reply(
    reasoning: str | None,
    content: str | None,
    finish: str = "stop",
    token_ids: list[int] | None = None,
    completion_tokens: int | None = None,
) -> tuple[int, dict]:
    """A 200 chat completion; token ids and usage only when given (as vLLM sends them)."""
    message = {"role": "assistant", "content": content, "reasoning": reasoning}
    choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": finish}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    body: dict[str, Any] = {"choices": [choice]}
    if completion_tokens is not None:
        body["usage"] = {"completion_tokens": completion_tokens}
    return 200, body


def error(status: int, message: str, retry_after_s: float | None = None) -> tuple:
    """An OpenAI error answer; `retry_after_s`: with a `Retry-After` header (whole seconds)."""
    body = {"error": {"message": message, "type": "Error", "code": status}}
    if retry_after_s is None:
        return status, body
    return status, body, {"Retry-After": str(retry_after_s)}


def sequence(*answers: Any) -> Respond:
    """Answers in order, the last one repeated."""
    queue = list(answers)
    return lambda body: queue.pop(0) if len(queue) > 1 else queue[0]
