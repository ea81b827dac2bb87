"""A stand-in for a vLLM server with `extract_hidden_states`, replaying known hidden states.

It answers what speculators' online dataloader asks: GET /v1/models, and POST /v1/completions
with `prompt` = token ids and `max_tokens=1`. For each request it writes
`hidden_states [seq, n, hidden]` + `token_ids` to a safetensors file in `storage` (as vLLM's
connector does) and returns its path in `kv_transfer_params.hidden_states_path`, with
`prompt_token_ids`. `fault` makes it misbehave for the tests of online mode: a file that is
missing, truncated or NaN; other hidden states (another model) or one layer fewer; `stop()`
closes it as a dying server does. With `api_key`, every request without `Authorization: Bearer
<api_key>` is answered 401, as vLLM with `--api-key` does (counted in `refused`).
"""

from __future__ import annotations

import itertools
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

FAULTS = ("missing", "truncated", "nan", "other_model", "fewer_layers")


class ReplayServer:
    """`states`: token ids (tuple) -> hidden states [seq, n, hidden] to serve for them."""

    def __init__(
        self,
        states: dict[tuple[int, ...], torch.Tensor],
        storage: Path,
        model_id: str,
        *,
        fault: str | None = None,
        fault_after: int = 0,
        model_root: str = "/models/verifier",
        api_key: str | None = None,
    ) -> None:
        assert fault is None or fault in FAULTS, fault
        self.states = states
        self.storage = storage
        storage.mkdir(parents=True, exist_ok=True)
        self.fault = fault
        self.fault_after = fault_after  # requests answered well before the fault starts
        self.model_id = model_id  # speculators asks for the trainer's verifier path
        self.model_root = model_root
        self.requests = 0
        self.api_key = api_key
        self.refused = 0  # requests without the key
        self.asked: list[tuple[int, ...]] = []  # token ids of each request, in order
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> ReplayServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        """Stop answering and close the port (connections are then refused)."""
        if self._thread.is_alive():
            self.httpd.shutdown()
        self.httpd.server_close()

    def _answer(self, body: dict[str, Any]) -> dict[str, Any]:
        ids = [int(t) for t in body["prompt"]]
        with self._lock:
            self.requests += 1
            self.asked.append(tuple(ids))
            n = next(self._ids)
            faulty = self.fault is not None and self.requests > self.fault_after
        hidden = self.states[tuple(ids)].clone()
        path = self.storage / f"req-{n}.safetensors"
        if faulty and self.fault == "other_model":
            hidden = hidden * 1.5 + 0.25
        if faulty and self.fault == "fewer_layers":
            hidden = hidden[:, 1:].contiguous()
        if faulty and self.fault == "nan":
            hidden[len(ids) // 2, 0, 0] = float("nan")
        if not (faulty and self.fault == "missing"):
            save_file({"hidden_states": hidden, "token_ids": torch.tensor(ids)}, str(path))
        if faulty and self.fault == "truncated":
            data = path.read_bytes()
            path.write_bytes(data[: len(data) // 2])
        return {
            "id": f"cmpl-{n}",
            "object": "text_completion",
            "created": 0,
            "model": self.model_id,
            "choices": [
                {"index": 0, "text": "x", "finish_reason": "length", "prompt_token_ids": ids}
            ],
            "kv_transfer_params": {"hidden_states_path": str(path)},
        }

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, payload: Any) -> None:
                data = json.dumps(payload).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _refused(self) -> bool:
                if server.api_key is None:
                    return False
                if self.headers.get("Authorization") == f"Bearer {server.api_key}":
                    return False
                with server._lock:
                    server.refused += 1
                data = b'{"error": "Unauthorized"}'
                self.send_response(401)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                return True

            def do_GET(self) -> None:
                if self._refused():
                    return
                self._send(
                    {
                        "object": "list",
                        "data": [
                            {
                                "id": server.model_id,
                                "object": "model",
                                "created": 0,
                                "owned_by": "vllm",
                                "root": server.model_root,
                            }
                        ],
                    }
                )

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if not self._refused():
                    self._send(server._answer(body))

        return Handler
