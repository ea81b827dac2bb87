"""Prompts leased to servers: one server or a fleet, the same loop.

Each prompt id is leased to one server at a time; `concurrency` threads per server take leases in id
order and send the requests. A server is lost when it stops answering (a request failed the
transient way and /v1/models does not answer) or when its watch says so (within a second or two: the
server's watch in this process, or the Ray worker that ran it saw it stop, or died): its open leases
go back to the front of the queue for the others. Replies come back to the caller's thread, which
alone settles a lease and writes the journal, so a reply that arrives after its server was declared
lost and the same prompt's reply from the server that took it over cannot both be written: the first
settles it, the other is dropped. A prompt whose server was lost under it `max_losses` times is
failed (it may be what kills the servers) instead of taking the whole fleet down.
"""

from __future__ import annotations

import collections
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from eagle3_pipeline.serving.chat import ChatClient, ChatReply, RequestFailed

POLL_S = 0.5  # how often the caller's thread asks the watchers while no reply comes


@dataclass
class Server:
    """One server of the fleet: `label` names it in logs and provenance (its node, or its URL);
    `gone()` answers why once the server is known dead without asking it over HTTP (a cluster
    node's worker saw it stop), else None."""

    label: str
    client: ChatClient
    gone: Callable[[], str | None] = field(default=lambda: None)


def down(server: Server) -> str | None:
    """Why `server` stopped, as its watch (a server this process started: serving/server_process.py)
    or its node's worker saw it; None while it serves or nobody has seen it stop."""
    return server.client.down() or server.gone()


@dataclass(frozen=True)
class Lost:
    """A server declared lost: why, the ids given back to the queue and the ids given up."""

    server: str
    reason: str
    released: list[str]
    given_up: list[str]


class Leases:
    """Which server holds which prompt; thread-safe. Settled = answered or failed for good."""

    def __init__(self, ids: list[str], servers: list[str], max_losses: int) -> None:
        self._cond = threading.Condition()
        self._queue = collections.deque(ids)
        self._open: dict[str, set[str]] = {s: set() for s in servers}
        self._settled: set[str] = set()
        self._losses: collections.Counter[str] = collections.Counter()
        self._lost: set[str] = set()
        self._closed = False
        self.max_losses = max_losses
        self.total = len(ids)

    def take(self, server: str) -> str | None:
        """The next unsettled id for `server`; waits while others hold the last leases (they
        may come back); None once nothing is left, the server is lost, or all is closed."""
        with self._cond:
            while True:
                if self._closed or server in self._lost:
                    return None
                while self._queue and self._queue[0] in self._settled:
                    self._queue.popleft()
                if self._queue:
                    job = self._queue.popleft()
                    self._open[server].add(job)
                    return job
                if not any(self._open.values()):
                    return None
                self._cond.wait()

    def settle(self, server: str, job: str) -> bool:
        """Record `job` answered (or failed for good) by `server`; False if it already was."""
        with self._cond:
            self._open.get(server, set()).discard(job)
            first = job not in self._settled
            self._settled.add(job)
            self._cond.notify_all()
            return first

    def lose(self, server: str, reason: str) -> Lost | None:
        """Declare `server` lost: its open leases back to the front of the queue (in id order),
        or given up after max_losses losses; None if it was already lost."""
        with self._cond:
            if server in self._lost:
                return None
            self._lost.add(server)
            held = sorted(self._open.pop(server, set()) - self._settled)
            released, given_up = [], []
            for job in held:
                self._losses[job] += 1
                (given_up if self._losses[job] >= self.max_losses else released).append(job)
            self._queue.extendleft(reversed(released))
            self._settled.update(given_up)
            self._cond.notify_all()
            return Lost(server, reason, released, given_up)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def is_lost(self, server: str) -> bool:
        with self._cond:
            return server in self._lost

    @property
    def alive(self) -> list[str]:
        with self._cond:
            return [s for s in self._open if s not in self._lost]

    @property
    def unsettled(self) -> int:
        with self._cond:
            return self.total - len(self._settled)


@dataclass(frozen=True)
class Reply:
    server: str
    id: str
    reply: ChatReply


@dataclass(frozen=True)
class Failed:
    server: str
    id: str
    error: str


@dataclass
class Tally:
    """Who answered what, over every lease run of a stage (provenance)."""

    ids_by_server: dict[str, list[str]] = field(default_factory=dict)
    lost: list[dict[str, Any]] = field(default_factory=list)
    failed_by_server: collections.Counter[str] = field(default_factory=collections.Counter)

    def record(self) -> dict[str, Any]:
        servers = {
            label: {"rows": len(ids), "failed": self.failed_by_server[label], "ids": sorted(ids)}
            for label, ids in self.ids_by_server.items()
        }
        re_leased = sorted({i for x in self.lost for i in x["released"]})
        return {"servers": servers, "lost": self.lost, "re_leased": re_leased}


class AllLost(Exception):
    """Every server of the fleet was lost with prompts unanswered (`last`: the last loss)."""

    def __init__(self, last: Lost, unsettled: int) -> None:
        super().__init__(last.reason)
        self.last = last
        self.unsettled = unsettled


def _send(
    server: Server,
    leases: Leases,
    bodies: dict[str, dict[str, Any]],
    model: str,
    results: queue.Queue,
) -> None:
    """One of a server's `concurrency` threads: take a lease, send it, hand the outcome over."""
    try:
        while (job := leases.take(server.label)) is not None:
            try:
                reply = server.client.chat(bodies[job] | {"model": model})
            except RequestFailed as exc:
                if leases.is_lost(server.label):
                    return  # the lease went back to the queue with the server
                if why := down(server):
                    results.put(("lost", server.label, why))
                    return
                if server.client.cancelled.is_set():
                    return
                if exc.transient and not server.client.answers():
                    results.put(("lost", server.label, f"{job}: {exc}"))
                    return
                results.put(Failed(server.label, job, str(exc)))
                continue
            results.put(Reply(server.label, job, reply))
    except BaseException as exc:  # a bug, not a failed row: re-raised on the caller's thread
        results.put(exc)


def run(
    servers: list[Server],
    ids: list[str],
    bodies: dict[str, dict[str, Any]],
    models: dict[str, str],
    concurrency: int,
    on_reply: Callable[[Reply], None],
    on_failed: Callable[[Failed], None],
    on_lost: Callable[[Lost], None],
    max_losses: int,
    tally: Tally | None = None,
) -> Tally:
    """Lease every id in `ids` to `servers` until each is answered or failed for good.

    Servers lost in an earlier run with the same `tally` are left out.
    `bodies[id]`: the request without its model; `models[label]`: the model name that server
    serves. The callbacks run on this thread only: `on_reply` journals (it is called once per
    id), `on_failed` keeps the sidecar row, `on_lost` logs. Raises AllLost when no server is
    left with ids unanswered; any exit cancels the servers' requests in flight.
    """
    tally = tally or Tally()
    gone_before = {x["server"] for x in tally.lost}  # lost in an earlier run (turn) of the stage
    servers = [s for s in servers if s.label not in gone_before]
    if not servers:
        raise AllLost(Lost("", "every server was lost in an earlier turn", [], []), len(ids))
    for s in servers:
        tally.ids_by_server.setdefault(s.label, [])
    leases = Leases(ids, [s.label for s in servers], max_losses)
    results: queue.Queue = queue.Queue()
    by_label = {s.label: s for s in servers}
    for s in servers:
        s.client.cancelled.clear()
        for _ in range(min(concurrency, len(ids))):
            threading.Thread(
                target=_send, args=(s, leases, bodies, models[s.label], results), daemon=True
            ).start()

    def lose(label: str, reason: str) -> None:
        lost = leases.lose(label, reason)
        by_label[label].client.cancelled.set()  # its requests in flight end now
        if lost is None:
            return
        tally.lost.append(
            {
                "server": label,
                "reason": reason,
                "released": lost.released,
                "given_up": lost.given_up,
            }
        )
        for job in lost.given_up:
            tally.failed_by_server[label] += 1
            on_failed(Failed(label, job, f"lost with its server {max_losses} times ({reason})"))
        on_lost(lost)
        if not leases.alive and leases.unsettled:
            raise AllLost(lost, leases.unsettled)

    try:
        while leases.unsettled:
            try:
                item = results.get(timeout=POLL_S)
            except queue.Empty:
                item = None
            if isinstance(item, BaseException):
                raise item
            if isinstance(item, tuple):  # ("lost", label, reason) from a sending thread
                lose(item[1], item[2])
            elif isinstance(item, Reply):
                if leases.settle(item.server, item.id):
                    on_reply(item)
                    tally.ids_by_server[item.server].append(item.id)
            elif isinstance(item, Failed) and leases.settle(item.server, item.id):
                tally.failed_by_server[item.server] += 1
                on_failed(item)
            for s in servers:
                if not leases.is_lost(s.label) and (why := down(s)):
                    lose(s.label, why)
            if not leases.alive and leases.unsettled:  # lost before this loop looked
                raise AllLost(Lost("", "no server left", [], []), leases.unsettled)
    finally:
        leases.close()
        for s in servers:
            s.client.cancelled.set()
    return tally
