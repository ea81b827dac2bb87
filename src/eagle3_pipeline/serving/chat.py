"""Chat completions against an OpenAI-compatible server (vLLM), concurrent and retried.

Transient failures (connection errors, timeouts, 5xx) are retried with exponential backoff: a
server under load or restarting should not cost rows. A 4xx is the request's own fault (prompt
too long, bad parameter) and would fail again, so it is never retried. A request that still fails
becomes an `Outcome` with a one-line reason instead of an exception, so one bad row never stops
a run of thousands. Results come back on the caller's thread, where journaling is safe.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import requests

from eagle3_pipeline.core.errors import ServerError
from eagle3_pipeline.core.progress import log
from eagle3_pipeline.serving import auth

CONNECT_TIMEOUT_S = 10.0
# The key sent to servers the user runs (generate.server_url(s)); servers the pipeline starts
# get a fresh key per run instead.
API_KEY_VAR = "EAGLE3_VLLM_API_KEY"
_log_lock = threading.Lock()  # one retry line at a time: print() writes text and newline apart


class RequestFailed(Exception):
    """A request that failed for good; the message is the reason kept in the sidecar.

    `transient`: it failed the retryable way (no answer, 5xx) every time, which hints that the
    server itself is gone, rather than being refused (4xx).
    """

    def __init__(self, reason: str, transient: bool = False) -> None:
        super().__init__(reason)
        self.transient = transient


@dataclass(frozen=True)
class ChatReply:
    """`token_ids`: the generated ids, the one that ended the turn included, and
    `prompt_token_ids`: the prompt as the server tokenized it (vLLM, with `return_token_ids`);
    `completion_tokens`: the usage count; None where the server sent none."""

    reasoning: str | None
    content: str
    finish_reason: str
    token_ids: list[int] | None = None
    completion_tokens: int | None = None
    prompt_token_ids: list[int] | None = None


@dataclass(frozen=True)
class Outcome:
    """What became of one job: a reply, or the reason it failed."""

    id: str
    reply: ChatReply | None = None
    error: str | None = None
    transient: bool = False


def parse_reply(response: dict[str, Any]) -> ChatReply:
    """The first choice; reasoning from `reasoning` (vLLM >= 0.10) or `reasoning_content`."""
    try:
        choice = response["choices"][0]
        message = choice["message"]
    except (KeyError, IndexError, TypeError):
        raise RequestFailed(f"malformed response: {str(response)[:200]}") from None
    reasoning = message.get("reasoning")
    if reasoning is None:
        reasoning = message.get("reasoning_content")
    usage = response.get("usage")
    completion_tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
    token_ids = choice.get("token_ids")
    prompt_ids = response.get("prompt_token_ids")
    return ChatReply(
        reasoning=reasoning,
        content=message.get("content") or "",
        finish_reason=choice.get("finish_reason") or "unknown",
        token_ids=list(token_ids) if token_ids is not None else None,
        completion_tokens=int(completion_tokens) if completion_tokens is not None else None,
        prompt_token_ids=list(prompt_ids) if prompt_ids is not None else None,
    )


def _root_cause(exc: BaseException) -> str:
    """`ConnectionRefusedError: [Errno 111] Connection refused`, not requests' nested repr."""
    while True:
        inner = getattr(exc, "reason", None) or exc.__cause__ or exc.__context__
        if inner is None and exc.args and isinstance(exc.args[-1], BaseException):
            inner = exc.args[-1]
        if not isinstance(inner, BaseException) or inner is exc:
            return f"{type(exc).__name__}: {exc}"
        exc = inner


def _error_text(resp: requests.Response) -> str:
    """The server's own message (OpenAI error JSON) or the start of the body."""
    try:
        err = resp.json().get("error", {})
        text = err.get("message") if isinstance(err, dict) else str(err)
    except (ValueError, AttributeError):
        text = None
    return " ".join((text or resp.text or resp.reason or "").split())[:300]


class ChatClient:
    """POSTs to one server with retries; safe to share between threads (a session per thread)."""

    def __init__(
        self,
        base_url: str,
        timeout_s: float = 300.0,
        max_retries: int = 4,
        backoff_s: float = 1.0,
        max_backoff_s: float = 30.0,
        stage: str = "chat",
        api_key: str | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._headers = auth.bearer(api_key)  # never logged: no repr, no message shows it
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.stage = stage
        self.cancelled = threading.Event()
        self.retries = 0
        self._lock = threading.Lock()
        self._local = threading.local()

    def _session(self) -> requests.Session:
        if not hasattr(self._local, "session"):
            self._local.session = requests.Session()
            self._local.session.headers.update(self._headers)
        return self._local.session

    def backoff(self, attempt: int) -> float:
        """Seconds to wait before retry number `attempt` (0-based): doubling, capped."""
        return min(self.backoff_s * 2**attempt, self.max_backoff_s)

    def _attempt(self, path: str, body: dict[str, Any]) -> tuple[dict[str, Any] | None, str]:
        """(json, "") on success, (None, reason) on a retryable failure; 4xx raise at once."""
        try:
            resp = self._session().post(
                self.base_url + path, json=body, timeout=(CONNECT_TIMEOUT_S, self.timeout_s)
            )
        except requests.Timeout:
            return None, f"timed out after {self.timeout_s:.0f} s"
        except requests.ConnectionError as exc:
            return None, f"connection error: {' '.join(_root_cause(exc).split())[:200]}"
        if 400 <= resp.status_code < 500:
            raise RequestFailed(f"HTTP {resp.status_code}: {_error_text(resp)}")
        if resp.status_code >= 500:
            return None, f"HTTP {resp.status_code}: {_error_text(resp)}"
        try:
            return resp.json(), ""
        except ValueError:
            return None, f"invalid JSON in HTTP {resp.status_code} response"

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """The JSON answer to one POST, retried; raises RequestFailed with the last reason."""
        for attempt in range(self.max_retries + 1):
            if self.cancelled.is_set():
                raise RequestFailed("cancelled")
            data, reason = self._attempt(path, body)
            if data is not None:
                return data
            if attempt == self.max_retries:
                break
            if self.cancelled.is_set():  # its server was given up meanwhile: no retry to log
                raise RequestFailed("cancelled")
            delay = self.backoff(attempt)
            with self._lock:
                self.retries += 1
            with _log_lock:
                log(
                    self.stage, f"retry {attempt + 1}/{self.max_retries} in {delay:.1f} s: {reason}"
                )
            if self.cancelled.wait(delay):
                raise RequestFailed("cancelled")
        raise RequestFailed(
            f"{reason} (gave up after {self.max_retries + 1} attempts)", transient=True
        )

    def chat(self, body: dict[str, Any]) -> ChatReply:
        return parse_reply(self.post("/v1/chat/completions", body))

    def answers(self) -> bool:
        """Whether the server still answers at all (GET /v1/models, any OpenAI server has it)."""
        try:
            url = f"{self.base_url}/v1/models"
            return self._session().get(url, timeout=CONNECT_TIMEOUT_S).status_code == 200
        except requests.RequestException:
            return False

    def served_model(self, preferred: str) -> str:
        """`preferred` if the server serves it, else its only model; a clear error otherwise."""
        try:
            resp = self._session().get(f"{self.base_url}/v1/models", timeout=CONNECT_TIMEOUT_S)
            if resp.status_code == 401:
                given = "a wrong one was" if self._headers else "none was"
                raise ServerError(
                    f"{self.base_url}/v1/models: HTTP 401: the server wants an API key and "
                    f"{given} sent: export {API_KEY_VAR} with the server's key"
                )
            resp.raise_for_status()
            ids = [m["id"] for m in resp.json()["data"]]
        except (requests.RequestException, ValueError, KeyError, TypeError) as exc:
            raise ServerError(
                f"{self.base_url}/v1/models: no answer from the server ({type(exc).__name__}): "
                "check generate.server_url(s) and that the server is up"
            ) from None
        if preferred in ids:
            return preferred
        if len(ids) == 1:
            return ids[0]
        raise ServerError(
            f"{self.base_url} serves {ids}, not '{preferred}': serve the verifier as "
            f"--served-model-name {preferred}"
        )


def _worker(client: ChatClient, jobs: queue.Queue, results: queue.Queue) -> None:
    while not client.cancelled.is_set():
        try:
            job_id, body = jobs.get_nowait()
        except queue.Empty:
            return
        try:
            results.put(Outcome(job_id, reply=client.chat(body)))
        except RequestFailed as exc:
            results.put(Outcome(job_id, error=str(exc), transient=exc.transient))
        except BaseException as exc:  # a bug, not a failed row: re-raised on the caller's thread
            results.put(exc)


def complete_all(
    client: ChatClient,
    jobs: list[tuple[str, dict[str, Any]]],
    concurrency: int,
    on_outcome: Callable[[Outcome], None],
) -> None:
    """Send every (id, body) with `concurrency` requests in flight; call `on_outcome` per job.

    Workers are daemon threads and the client is cancelled on any exit (Ctrl-C included), so an
    interrupted run neither waits for requests in flight nor retries against a stopped server.
    """
    todo: queue.Queue = queue.Queue()
    for job in jobs:
        todo.put(job)
    results: queue.Queue = queue.Queue()
    for _ in range(min(concurrency, len(jobs))):
        threading.Thread(target=_worker, args=(client, todo, results), daemon=True).start()
    try:
        for _ in range(len(jobs)):
            item = results.get()
            if isinstance(item, BaseException):
                raise item
            on_outcome(item)
    finally:
        client.cancelled.set()
