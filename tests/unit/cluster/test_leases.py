"""cluster/leases.py: prompts leased to a fleet of (fake) servers; a lost server's prompts finish
on the others; no id is settled, so journaled, twice. Against real vLLM on a 2-node Ray cluster:
tests/e2e/test_cluster_generate.py."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from fake_openai import DROP, fake_servers, reply
from fake_openai import row_id as _row_id

from eagle3_pipeline.cluster import leases
from eagle3_pipeline.serving.chat import ChatClient

IDS = [f"q{i:02d}" for i in range(12)]


def test_take_settle_lose_give_back_in_id_order_and_settle_once() -> None:
    book = leases.Leases(IDS[:5], ["a", "b"], max_losses=2)
    assert [book.take("a"), book.take("b"), book.take("a")] == ["q00", "q01", "q02"]
    assert book.settle("a", "q00") is True
    lost = book.lose("a", "gone")
    assert lost is not None and lost.released == ["q02"] and lost.given_up == []
    assert book.lose("a", "again") is None  # once
    assert book.take("a") is None  # a lost server takes nothing more
    assert book.take("b") == "q02"  # back at the front of the queue, before q03
    # A reply from the lost server that arrives late and the one of its successor: one settles.
    assert book.settle("a", "q02") is True
    assert book.settle("b", "q02") is False
    assert book.alive == ["b"] and book.unsettled == 3


def test_a_prompt_lost_with_its_server_max_losses_times_is_given_up() -> None:
    book = leases.Leases(["q00"], ["a", "b", "c"], max_losses=2)
    assert book.take("a") == "q00"
    assert book.lose("a", "x").released == ["q00"]
    assert book.take("b") == "q00"
    assert book.lose("b", "x").given_up == ["q00"]
    assert book.unsettled == 0 and book.take("c") is None


def test_take_waits_while_another_server_holds_the_last_lease() -> None:
    book = leases.Leases(["q00"], ["a", "b"], max_losses=3)
    assert book.take("a") == "q00"
    got: list[Any] = []
    waiter = threading.Thread(target=lambda: got.append(book.take("b")))
    waiter.start()
    time.sleep(0.2)
    assert got == []  # b waits: a's lease may come back
    book.lose("a", "gone")
    waiter.join(5)
    assert got == ["q00"]


# ---------------------------------------------------------------------------------------------
# run(): the loop against fake servers


@pytest.fixture
def fake() -> Iterator:
    with fake_servers() as start:
        yield start


def _answer(body: dict) -> tuple[int, dict]:
    rid = _row_id(body)
    return reply(None, f"answer {rid}", token_ids=[1, 2])


def _bodies(ids: list[str]) -> dict[str, dict]:
    return {i: {"messages": [{"role": "user", "content": f"question {i}"}]} for i in ids}


def _server(label: str, url: str, **kw: Any) -> leases.Server:
    client = ChatClient(url, timeout_s=30, max_retries=2, stage="test")
    return leases.Server(label, client, **kw)


def _run(servers: list[leases.Server], ids: list[str], concurrency: int = 2, **kw: Any):
    journal: list[tuple[str, str]] = []
    failed: list[str] = []
    lost: list[leases.Lost] = []
    tally = leases.run(
        servers,
        ids,
        _bodies(ids),
        {s.label: "verifier" for s in servers},
        concurrency,
        on_reply=lambda r: journal.append((r.id, r.server)),
        on_failed=lambda f: failed.append(f.id),
        on_lost=lost.append,
        max_losses=kw.pop("max_losses", 3),
        **kw,
    )
    return journal, failed, lost, tally


def test_every_prompt_goes_to_one_server_once(fake) -> None:
    a, b = fake(_answer), fake(_answer)
    journal, failed, lost, tally = _run([_server("a", a.url), _server("b", b.url)], IDS)
    assert sorted(i for i, _ in journal) == IDS and not failed and not lost
    assert sorted(a.requested_ids() + b.requested_ids()) == IDS  # no prompt sent twice
    assert a.requested_ids() and b.requested_ids()  # both served
    record = tally.record()
    assert record["servers"]["a"]["ids"] == sorted(a.requested_ids())
    assert record["servers"]["a"]["rows"] + record["servers"]["b"]["rows"] == len(IDS)
    assert record["lost"] == [] and record["re_leased"] == []
    assert a.max_in_flight <= 2 and b.max_in_flight <= 2  # concurrency is per server


def test_a_server_lost_mid_run_gives_its_prompts_to_the_other(fake) -> None:
    """b answers two prompts, then hangs up on every request and stops answering /v1/models:
    its open lease goes back to the queue, a finishes everything, each id journaled once."""

    def dies_after_two(body: dict) -> Any:
        if len(b.bodies) <= 2:
            return _answer(body)
        b.models_status = 503
        return DROP

    def slow(body: dict) -> Any:
        time.sleep(0.05)
        return _answer(body)

    a, b = fake(slow), fake(dies_after_two)
    journal, failed, lost, tally = _run([_server("a", a.url), _server("b", b.url)], IDS, 1)
    ids = [i for i, _ in journal]
    assert sorted(ids) == IDS and len(ids) == len(set(ids)) and not failed
    assert [x.server for x in lost] == ["b"]
    released = lost[0].released
    assert len(released) == 1 and released[0] in a.requested_ids()
    assert dict(journal)[released[0]] == "a"
    record = tally.record()
    assert record["servers"]["b"]["rows"] == 2 and record["servers"]["a"]["rows"] == 10
    assert record["re_leased"] == released and record["lost"][0]["server"] == "b"


def test_a_watcher_declares_a_hung_server_lost_without_waiting_for_http(fake) -> None:
    """A server whose worker says it is gone (Ray: the server exited, or its node died) loses
    its leases at once, even while its requests hang."""
    hang = threading.Event()

    def hangs(body: dict) -> Any:
        hang.wait(30)
        return DROP

    a, b = fake(_answer), fake(hangs)
    flag = threading.Event()
    why = "vLLM server b stopped: vLLM was killed by SIGKILL"  # as its worker's watch says
    gone_b = _server("b", b.url, gone=lambda: why if flag.is_set() else None)
    threading.Timer(0.5, flag.set).start()
    t0 = time.monotonic()
    try:
        journal, failed, lost, _ = _run([_server("a", a.url), gone_b], IDS, 1)
    finally:
        hang.set()
    assert time.monotonic() - t0 < 10
    assert sorted(i for i, _ in journal) == IDS and not failed
    assert lost[0].server == "b" and lost[0].reason == why
    assert all(server == "a" for _, server in journal)


def test_every_server_lost_raises_all_lost_with_what_is_left(fake) -> None:
    def dead(body: dict) -> Any:
        a.models_status = 503
        return DROP

    a = fake(dead)
    with pytest.raises(leases.AllLost) as exc:
        _run([_server("a", a.url)], IDS[:3], 1)
    assert exc.value.unsettled == 3 and "connection error" in exc.value.last.reason


def test_failed_rows_stay_failed_and_a_later_turn_skips_lost_servers(fake) -> None:
    """A 4xx is the row's own failure (not a lost server); a server lost in turn 1 gets no
    leases in turn 2."""

    def refuses_q01(body: dict) -> Any:
        time.sleep(0.05)  # b takes its lease before a has answered everything
        if _row_id(body) == "q01":
            return 400, {"error": {"message": "too long"}}
        return _answer(body)

    a = fake(refuses_q01)
    b = fake(lambda body: DROP)
    b.models_status = 503
    servers = [_server("a", a.url), _server("b", b.url)]
    journal, failed, lost, tally = _run(servers, IDS[:4], 1)
    assert failed == ["q01"] and sorted(i for i, _ in journal) == ["q00", "q02", "q03"]
    assert [x.server for x in lost] == ["b"]
    b.bodies.clear()
    journal2, _, _, _ = _run(servers, ["t2"], 1, tally=tally)
    assert journal2 == [("t2", "a")] and b.bodies == []
