"""A started vLLM server's processes: stopping them, and watching that they still serve.

A `Watch` asks once a second whether a ready server still serves: its watchdog and vLLM's
processes alive, /health answering. A server that stopped (killed, out of memory, its engine
dead, shutting down) is declared down within seconds, with the cause in one line; its remaining
processes are stopped at once, so requests in flight end instead of waiting out their timeouts,
and chat clients of its URL send nothing more (`down_reason`; serving/chat.py). Servers are
started in server.py.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import psutil
import requests

from eagle3_pipeline.core.progress import log


class _Spec(Protocol):
    log_file: Path


class Started(Protocol):
    """What a Watch reads of a started server (server.Launched)."""

    proc: subprocess.Popen
    spec: _Spec

    @property
    def url(self) -> str: ...


def stop(proc: subprocess.Popen, grace_s: float = 20.0) -> None:
    """SIGTERM the whole process group (vLLM forks workers), then SIGKILL, and reap."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    # Workers that outlived the leader are still in the group.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    if proc.stdin is not None:
        proc.stdin.close()


def tail(path: Path, n: int = 5) -> str:
    """The last `n` non-empty lines of a server's log, joined on one line ("" if unreadable)."""
    try:
        lines = [x for x in path.read_text(errors="replace").splitlines() if x.strip()]
    except OSError:
        return ""
    return " | ".join(lines[-n:])


WATCH_INTERVAL_S = 1.0
# /health must fail this many polls in a row (refused, or an answer other than 200): a busy
# server that is slow to answer is not a stopped one, so a timeout alone never counts.
HEALTH_FAILURES = 3
_down: dict[str, str] = {}  # base URL -> why that server stopped serving (set by its Watch)
_down_lock = threading.Lock()


def down_reason(url: str, wait_s: float = 0.0) -> str | None:
    """Why the server this process started at `url` stopped serving; None while it serves (and
    for servers it did not start). `wait_s`: how long to wait for its watch's verdict, where a
    request has just failed (the watch polls every WATCH_INTERVAL_S)."""
    deadline = time.monotonic() + wait_s
    while True:
        with _down_lock:
            why = _down.get(url.rstrip("/"))
        if why or time.monotonic() >= deadline:
            return why
        time.sleep(0.1)


def exit_cause(returncode: int) -> str:
    """The watchdog's exit status in words: it exits with vLLM's code (128+N: vLLM killed by
    signal N, as a shell says); a negative status means the watchdog itself was killed."""
    if returncode < 0:
        return f"its watchdog was killed by {_signal_name(-returncode)}"
    if returncode > 128:
        return f"vLLM was killed by {_signal_name(returncode - 128)}"
    return f"vLLM exited with code {returncode}"


def _signal_name(n: int) -> str:
    try:
        return signal.Signals(n).name
    except ValueError:
        return f"signal {n}"


def _engines(started: Started) -> list[int]:
    """The pids of vLLM's engine core under the server (the watchdog's child, the API server,
    forked it; its own workers, where there are any, take it down with them). Other children,
    such as multiprocessing's resource tracker, come and go with the server: not watched. The
    API server itself is the watchdog's only child: its end is the watchdog's."""
    try:
        servers = psutil.Process(started.proc.pid).children()
    except psutil.NoSuchProcess:
        return []
    found = []
    for p in servers:
        with contextlib.suppress(psutil.NoSuchProcess):
            # vLLM names it VLLM::EngineCore (the kernel keeps 15 characters of that)
            found += [c.pid for c in p.children() if "EngineCor" in c.name()]
    return found


def _health_failure(url: str) -> str | None:
    """Why GET /health failed for good (refused, or not 200); None if it answered 200 or only
    took long."""
    try:
        status = requests.get(f"{url}/health", timeout=WATCH_INTERVAL_S * 2).status_code
    except requests.ConnectionError:
        return "it refuses connections (shutting down)"
    except requests.RequestException:
        return None
    return None if status == 200 else f"/health answered HTTP {status}"


class Watch:
    """Watches one ready server in a daemon thread until it stops serving or `close()`.

    Down when: the watchdog exited (vLLM exited, or was killed, or the watchdog was), vLLM's
    engine process known at start is gone, or /health failed
    HEALTH_FAILURES polls in a row. Then `reason` holds the cause in one line (with the log's
    last lines), `down_reason(url)` answers it, and the server's remaining processes are
    stopped: requests in flight end now, not after their timeouts."""

    def __init__(self, started: Started, on_down: Callable[[str], None] | None = None) -> None:
        self.started = started
        self.url = started.url
        self.reason: str | None = None
        self._on_down = on_down
        self._engines = _engines(started)
        self._health_failures = 0  # failed /health polls in a row
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"watch {self.url}", daemon=True)
        self._thread.start()

    def cause(self) -> str | None:
        """Why the server no longer serves, from one poll; None while it does. A process that
        died first is named first: an engine killed makes vLLM exit with code 0 a moment later,
        a killed watchdog makes vLLM and its engine exit."""
        code = self.started.proc.poll()
        if code is not None and (code < 0 or code > 128):
            return exit_cause(code)
        for pid in self._engines:
            try:
                alive = psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                alive = False
            if not alive:
                then = f", then {exit_cause(code)}" if code is not None else ""
                return f"its engine process (pid {pid}) died{then}"
        if code is not None:
            return exit_cause(code)
        failure = _health_failure(self.url)
        self._health_failures = self._health_failures + 1 if failure else 0
        return failure if self._health_failures >= HEALTH_FAILURES else None

    def _loop(self) -> None:
        while not self._closed.wait(WATCH_INTERVAL_S):
            cause = self.cause()
            if cause is None:
                continue
            reason = self.describe(cause)
            with _down_lock:
                if self._closed.is_set():  # being stopped on purpose: not a failure
                    return
                self.reason = _down[self.url] = reason
            log("vllm", reason)
            stop(self.started.proc, grace_s=2.0)
            if self._on_down is not None and not self._closed.is_set():
                self._on_down(reason)
            return

    def describe(self, cause: str) -> str:
        """The one line that says this server stopped: its URL, the cause, its log's tail."""
        log_file = self.started.spec.log_file
        last = tail(log_file, 3) or "empty"
        return f"vLLM server {self.url} stopped: {cause} (log {log_file}: {last})"

    def close(self) -> None:
        """Stop watching (the server is being stopped on purpose)."""
        with _down_lock:
            self._closed.set()
            _down.pop(self.url, None)
