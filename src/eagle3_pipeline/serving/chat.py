"""Chat completions against vLLM's OpenAI API, concurrent, on the `openai` client.

openai retries what may pass (no answer, timeouts, 408, 409, 429, 5xx) with backoff, after the
server's `Retry-After`; any other 4xx is the request's own fault and fails at once. A request
that still fails is one line of reason, never an exception that stops a run of thousands.
Two httpx event hooks add the rest: each retry is logged and counted (openai numbers attempts in
`x-stainless-retry-count`), and a cancelled client, or one whose server was declared down by its
watch (serving/server_process.py), sends no further attempt: the failure then says why the
server stopped.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import openai
from openai.types.chat import ChatCompletion

from eagle3_pipeline.core.errors import ServerDown, ServerError
from eagle3_pipeline.core.progress import log
from eagle3_pipeline.serving.server_process import down_reason

if TYPE_CHECKING:
    import httpx2  # openai's transport

CONNECT_TIMEOUT_S = 10.0
POLL_S = 0.5  # how often a caller waiting for replies asks whether the server is still up
# The key sent to servers the user runs (generate.server_url(s)); servers the pipeline starts
# get a fresh key per run instead.
API_KEY_VAR = "EAGLE3_VLLM_API_KEY"
NO_KEY = "EMPTY"  # what openai sends when there is no key; a server without one ignores it
RETRY_HEADER = "x-stainless-retry-count"
_log_lock = threading.Lock()  # one retry line at a time: print() writes text and newline apart


class RequestFailed(Exception):
    """A request that failed for good: the reason kept in the sidecar. `transient`: it failed
    the retried way every time (no answer, 429, 5xx), a hint that the server itself is gone;
    `down`: the server this process started was seen to stop (the reason says why)."""

    def __init__(self, reason: str, transient: bool = False, down: bool = False) -> None:
        super().__init__(reason)
        self.transient = transient
        self.down = down


class _Cancelled(openai.OpenAIError):
    """Raised before an attempt of a cancelled client; openai passes its own errors through."""


class _Down(openai.OpenAIError):
    """Raised before an attempt to a server its watch declared down (the reason)."""


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


def parse_reply(response: ChatCompletion) -> ChatReply:
    """The first choice; reasoning from `reasoning` (vLLM >= 0.10) or `reasoning_content`; vLLM's
    extra fields are attributes of openai's models."""
    try:
        choice = response.choices[0]
        message = choice.message
    except (AttributeError, IndexError, TypeError):
        raise RequestFailed(f"malformed response: {str(response)[:200]}") from None
    reasoning = getattr(message, "reasoning", None)
    if reasoning is None:
        reasoning = getattr(message, "reasoning_content", None)
    usage = getattr(response, "usage", None)
    completion_tokens = getattr(usage, "completion_tokens", None)
    token_ids = getattr(choice, "token_ids", None)
    prompt_ids = getattr(response, "prompt_token_ids", None)
    return ChatReply(
        reasoning=reasoning,
        content=message.content or "",
        finish_reason=choice.finish_reason or "unknown",
        token_ids=list(token_ids) if token_ids is not None else None,
        completion_tokens=int(completion_tokens) if completion_tokens is not None else None,
        prompt_token_ids=list(prompt_ids) if prompt_ids is not None else None,
    )


def _root_cause(exc: BaseException) -> str:
    """`ConnectError: [Errno 111] Connection refused`, not the wrappers around it."""
    seen = {id(exc)}
    while isinstance(inner := exc.__cause__ or exc.__context__, BaseException):
        if id(inner) in seen:  # a chain that loops back
            break
        exc = inner
        seen.add(id(exc))
    return " ".join(f"{type(exc).__name__}: {exc}".split())[:200]


def _server_message(exc: openai.APIStatusError) -> str:
    """The server's own words (OpenAI error JSON), else the start of the body."""
    text = exc.body.get("message") if isinstance(exc.body, dict) else exc.body
    return " ".join(str(text or exc.response.text or exc.response.reason_phrase).split())[:300]


class ChatClient:
    """One server's client, shared by threads; `retries` counts the attempts after a first."""

    def __init__(
        self,
        base_url: str,
        timeout_s: float = 300.0,
        max_retries: int = 4,
        stage: str = "chat",
        api_key: str | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.stage = stage
        self.cancelled = threading.Event()
        self.retries = 0
        self._has_key = bool(api_key)
        self._lock = threading.Lock()
        self._local = threading.local()  # per thread: this request's attempts, last failure
        hooks = {"request": [self._before_attempt], "response": [self._after_attempt]}
        self._openai = openai.OpenAI(
            base_url=f"{self.base_url}/v1",
            api_key=api_key or NO_KEY,  # never logged: openai keeps it out of reprs
            max_retries=max_retries,
            timeout=openai.Timeout(timeout_s, connect=CONNECT_TIMEOUT_S),
            http_client=openai.DefaultHttpxClient(event_hooks=hooks),
        )

    def _before_attempt(self, request: httpx2.Request) -> None:
        if why := down_reason(self.base_url):
            raise _Down(why)
        if self.cancelled.is_set() and request.method == "POST":  # not /v1/models: a check
            raise _Cancelled("cancelled")
        attempt = int(request.headers.get(RETRY_HEADER, "0"))
        self._local.attempts = attempt + 1
        if attempt == 0:
            self._local.last = None
            return
        with self._lock:
            self.retries += 1
        reason = self._local.last or "no answer (connection failed or timed out)"
        self._local.last = None
        with _log_lock:
            log(self.stage, f"retry {attempt}/{self.max_retries}: {reason}")

    def _after_attempt(self, response: httpx2.Response) -> None:
        if response.status_code >= 400:
            self._local.last = f"HTTP {response.status_code}"

    def _gave_up(self) -> str:
        attempts = getattr(self._local, "attempts", 1)
        return f" (gave up after {attempts} attempts)" if attempts > 1 else ""

    def post(self, path: str, body: dict[str, Any]) -> ChatCompletion:
        """The answer to `body` sent as is (vLLM's fields too); RequestFailed in one line."""
        try:
            return self._openai.post(path, body=body, cast_to=ChatCompletion)
        except _Cancelled:
            raise RequestFailed("cancelled") from None
        except _Down as exc:
            raise RequestFailed(str(exc), transient=True, down=True) from None
        except openai.APIStatusError as exc:
            retried = exc.status_code in (408, 409, 429) or exc.status_code >= 500
            reason = f"HTTP {exc.status_code}: {_server_message(exc)}"
            raise RequestFailed(reason + self._gave_up(), transient=retried) from None
        except openai.APIConnectionError as exc:  # APITimeoutError is one
            reason = f"connection error: {_root_cause(exc)}"
            if isinstance(exc, openai.APITimeoutError):
                reason = f"timed out after {self.timeout_s:.0f} s"
            raise RequestFailed(reason + self._gave_up(), transient=True) from None

    def chat(self, body: dict[str, Any]) -> ChatReply:
        return parse_reply(self.post("/chat/completions", body))

    def _models(self) -> list[str]:
        once = self._openai.with_options(max_retries=0, timeout=CONNECT_TIMEOUT_S)
        return [m.id for m in once.models.list()]

    def down(self) -> str | None:
        """Why the server stopped, where this process started it and saw it stop (its watch)."""
        return down_reason(self.base_url)

    def answers(self) -> bool:
        """Whether the server still answers at all (GET /v1/models, any OpenAI server has it)."""
        if self.down():
            return False
        try:
            self._models()
        except openai.OpenAIError:
            return False
        return True

    def served_model(self, preferred: str) -> str:
        """`preferred` if the server serves it, else its only model; a clear error otherwise."""
        try:
            ids = self._models()
        except openai.AuthenticationError:
            given = "a wrong one was" if self._has_key else "none was"
            raise ServerError(
                f"{self.base_url}/v1/models: HTTP 401: the server wants an API key and "
                f"{given} sent: export {API_KEY_VAR} with the server's key"
            ) from None
        except openai.OpenAIError as exc:
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
            results.put(Outcome(job_id, error=str(exc)))
        except BaseException as exc:  # a bug, not a failed row: re-raised on the caller's thread
            results.put(exc)


def complete_all(
    client: ChatClient,
    jobs: list[tuple[str, dict[str, Any]]],
    concurrency: int,
    on_outcome: Callable[[Outcome], None],
) -> None:
    """Send every (id, body), `concurrency` in flight; `on_outcome` per job as each finishes.
    Workers are daemon threads and the client is cancelled on any exit (Ctrl-C included): an
    interrupted run neither waits for requests in flight nor retries against a stopped server.
    ServerDown, within a second, when the server's watch saw it stop (serving/server_process.py)."""
    todo: queue.Queue = queue.Queue()
    for job in jobs:
        todo.put(job)
    results: queue.Queue = queue.Queue()
    for _ in range(min(concurrency, len(jobs))):
        threading.Thread(target=_worker, args=(client, todo, results), daemon=True).start()
    try:
        left = len(jobs)
        while left:
            try:
                item = results.get(timeout=POLL_S)
            except queue.Empty:
                item = None
            if why := client.down():  # its server stopped: no reply in flight is coming
                raise ServerDown(why)
            if item is None:
                continue
            if isinstance(item, BaseException):
                raise item
            on_outcome(item)
            left -= 1
    finally:
        client.cancelled.set()
