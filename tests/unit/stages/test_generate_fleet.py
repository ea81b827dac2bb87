"""generate on several servers: a fleet of the user's (generate.server_urls) or one per node
(cluster.engine: ray, here with the node servers faked): the same rows as one server, which node
answered what in the cluster record, and the API key sent but never written anywhere.
The lease loop itself: tests/unit/cluster/test_leases.py; real vLLM on a 2-node Ray cluster:
tests/e2e/test_cluster_generate.py."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from builders import make_params, stand_in_verifier
from fake_openai import fake_servers, reply
from fake_openai import row_id as _row_id
from generate_workspace import prepare_rows, vllm_params

from eagle3_pipeline.cluster import engine
from eagle3_pipeline.cluster import record as cluster_record
from eagle3_pipeline.core import paths
from eagle3_pipeline.core.errors import ServerError
from eagle3_pipeline.serving.chat import API_KEY_VAR
from eagle3_pipeline.stages import generate


def _answer(body: dict) -> tuple[int, dict]:
    rid = _row_id(body)
    return reply(f"think {rid}", f"answer {rid}", token_ids=[len(rid), 7, 2])


def _outputs(root: Path) -> dict[str, bytes]:
    out = root / "data/generated"
    return {p.name: p.read_bytes() for p in sorted(out.iterdir())}


@pytest.fixture
def fake() -> Iterator:
    with fake_servers() as start:
        yield start


def test_a_fleet_writes_the_same_rows_as_one_server_and_records_who_answered(
    tmp_path: Path, fake, monkeypatch
) -> None:
    one, fleet = tmp_path / "one", tmp_path / "fleet"
    for root in (one, fleet):
        root.mkdir()
        prepare_rows(root, 10)
    monkeypatch.chdir(one)
    single = fake(_answer)
    generate.run(vllm_params(stand_in_verifier(one), server_url=single.url, concurrency=1))
    assert not cluster_record.RECORDS.exists()  # one server_url: as before, no cluster record

    monkeypatch.chdir(fleet)
    a, b = fake(_answer), fake(_answer)
    params = vllm_params(stand_in_verifier(fleet), server_urls=[a.url, b.url + "/"], concurrency=1)
    generate.run(params)
    assert _outputs(fleet) == _outputs(one)
    assert sorted(a.requested_ids() + b.requested_ids()) == sorted(single.requested_ids())
    rec = json.loads((fleet / cluster_record.RECORDS / "generate.json").read_text())
    assert rec["engine"] == "server_urls" and rec["concurrency_per_server"] == 1
    assert set(rec["servers"]) == {a.url, b.url}
    assert rec["servers"][a.url]["ids"] == sorted(a.requested_ids())
    assert sum(s["rows"] for s in rec["servers"].values()) == 10
    assert rec["lost"] == [] and rec["re_leased"] == []


class _KeyedServer:
    """An OpenAI-like server that wants `Authorization: Bearer <key>` on every request, as vLLM
    with --api-key; records the headers it saw."""

    def __init__(self, key: str) -> None:
        self.key = key
        self.auth_headers: list[str | None] = []
        keyed = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, status: int, payload: Any) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _authorized(self) -> bool:
                seen = self.headers.get("Authorization")
                keyed.auth_headers.append(seen)
                if seen != f"Bearer {keyed.key}":
                    self._send(401, {"error": "Unauthorized"})
                    return False
                return True

            def do_GET(self) -> None:
                if self._authorized():
                    self._send(200, {"object": "list", "data": [{"id": "verifier"}]})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self._authorized():
                    self._send(*_answer(body))

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"


@contextlib.contextmanager
def _keyed(key: str) -> Iterator[_KeyedServer]:
    import threading

    server = _KeyedServer(key)
    threading.Thread(target=server.httpd.serve_forever, args=(0.05,), daemon=True).start()
    try:
        yield server
    finally:
        server.httpd.shutdown()
        server.httpd.server_close()


def _scan_for(root: Path, secret: str) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]


def test_the_users_servers_get_the_key_from_the_environment_and_it_is_never_written(
    tmp_path: Path, monkeypatch, capfd
) -> None:
    monkeypatch.chdir(tmp_path)
    prepare_rows(tmp_path, 4)
    key = "sk-test-" + "x" * 24
    with _keyed(key) as a, _keyed(key) as b:
        params = vllm_params(stand_in_verifier(tmp_path), server_urls=[a.url, b.url])
        monkeypatch.delenv(API_KEY_VAR, raising=False)
        with pytest.raises(ServerError, match=rf"HTTP 401: .*none was sent: export {API_KEY_VAR}"):
            generate.run(params)
        monkeypatch.setenv(API_KEY_VAR, "wrong")
        with pytest.raises(ServerError, match="a wrong one was sent"):
            generate.run(params)
        monkeypatch.setenv(API_KEY_VAR, key)
        generate.run(params)
        assert f"Bearer {key}" in a.auth_headers and f"Bearer {key}" in b.auth_headers
    out, err = capfd.readouterr()
    assert key not in out + err
    assert _scan_for(tmp_path, key) == []  # no row, journal, record or log holds it


def test_cluster_engine_starts_one_keyed_server_per_node_on_its_address(
    tmp_path: Path, fake, monkeypatch, capfd
) -> None:
    """cluster.engine: ray, the Ray side faked: a server spec per node (its address, the run's
    key, distinct ports from generate.server_port), the key sent, the record names the nodes."""
    from eagle3_pipeline.cluster import servers as node_servers

    monkeypatch.chdir(tmp_path)
    prepare_rows(tmp_path, 8)
    nodes = [engine.Node("a" * 16, "10.0.0.1"), engine.Node("b" * 16, "10.0.0.2")]
    specs = []
    keys: list[str] = []

    @contextlib.contextmanager
    def fake_node_servers(c, spec_for, verifier_path) -> Iterator[list]:
        assert c.nodes == 2 and verifier_path == params.verifier.path
        started = []
        for i, node in enumerate(nodes):
            spec = spec_for(i, node)
            specs.append(spec)
            keyed = stack.enter_context(_keyed(spec.api_key))
            started.append(node_servers.NodeServer(node, keyed.url, lambda: False))
            keys.append(spec.api_key)
        yield started

    monkeypatch.setattr(node_servers, "node_servers", fake_node_servers)
    params = make_params(
        seed=7,
        verifier={"path": str(stand_in_verifier(tmp_path))},
        generate={"backend": "vllm", "max_new_tokens": 8, "server_port": 8410},
        cluster={"engine": "ray", "nodes": 2},
    )
    with contextlib.ExitStack() as stack:
        generate.run(params)
    assert [s.host for s in specs] == ["10.0.0.1", "10.0.0.2"]
    assert [(s.port, s.port_step) for s in specs] == [(8410, 2), (8411, 2)]
    assert [s.log_file.name for s in specs] == ["server-0.log", "server-1.log"]
    assert keys[0] == keys[1] and len(keys[0]) >= 32  # one fresh key for the run
    assert keys[0] not in repr(specs[0])
    rec = json.loads((tmp_path / cluster_record.RECORDS / "generate.json").read_text())
    assert rec["engine"] == "ray" and set(rec["servers"]) == {n.label for n in nodes}
    assert sum(s["rows"] for s in rec["servers"].values()) == 8
    out, err = capfd.readouterr()
    assert keys[0] not in out + err and _scan_for(tmp_path, keys[0]) == []
    assert _scan_for(tmp_path / paths.SCRATCH, "Bearer") == []
