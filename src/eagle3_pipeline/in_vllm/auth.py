"""The API key on every route of a vLLM server the pipeline starts, not only /v1.

vLLM's own `--api-key` (or VLLM_API_KEY) guards the /v1, /v2, /inference and /cohere prefixes
only: /invocations (SageMaker's route: the same completions), /metrics, /tokenize and the rest
stay open (vLLM's docs say so). A server started with `--middleware
eagle3_pipeline.in_vllm.auth.RequireKey` refuses any request without `Authorization: Bearer
<VLLM_API_KEY>`, except GET /health, which says nothing but "up" and which readiness polls.
The key is read from the server's environment (never from its command line, which `ps` shows
and the server log repeats).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
from typing import Any

from eagle3_pipeline.in_vllm import entry_points

KEY_VAR = "VLLM_API_KEY"
OPEN_PATHS = ("/health",)


def run_key() -> str:
    """A key for the servers one run starts: in no log, params, provenance or DVC file."""
    return secrets.token_urlsafe(32)


def bearer(key: str | None) -> dict[str, str]:
    """The request header that presents `key` (none without a key)."""
    return {"Authorization": f"Bearer {key}"} if key else {}


def _digest(text: str) -> bytes:
    return hashlib.sha256(text.encode()).digest()


class RequireKey:
    """Pure ASGI middleware (vLLM adds a class with `app.add_middleware(cls)`)."""

    def __init__(self, app: Any) -> None:
        key = os.environ.get(KEY_VAR)
        if not key:
            raise RuntimeError(
                f"{entry_points.AUTH_MIDDLEWARE} needs {KEY_VAR} in the server's environment"
            )
        self.app = app
        self._want = _digest(key)

    def _allowed(self, scope: dict) -> bool:
        path = scope.get("path", "").removeprefix(scope.get("root_path", ""))
        if path in OPEN_PATHS or scope.get("method") == "OPTIONS":
            return True
        for name, value in scope.get("headers", []):
            if name.lower() == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                return scheme.lower() == "bearer" and hmac.compare_digest(
                    _digest(token), self._want
                )
        return False

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket") or self._allowed(scope):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        body = json.dumps({"error": "Unauthorized"}).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
