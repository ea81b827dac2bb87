"""A real vLLM server that stops mid-stage (its API server, its engine or its watchdog killed,
as an out-of-memory killer or an operator might): `generate` and `evaluate`'s online pass end
within seconds in one line naming the server and the cause, and a rerun of generate finishes
with rows identical to an uninterrupted run. The mechanism against a stand-in:
tests/unit/serving/test_server_watch.py."""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
import requests
from generate_workspace import output_rows, prepare_rows, vllm_params
from server_procs import TAG_VAR, server_key, tagged_pids, wait_none_tagged

from eagle3_pipeline.config.params import Params
from eagle3_pipeline.core import atomic, paths, resume
from eagle3_pipeline.core.errors import ServerDown, ServerError
from eagle3_pipeline.stages import evaluate, generate

N_ROWS = 10
# Greedy, one request at a time: each row is computed alone, so rows answered by two servers
# equal one server's (CPU kernels are not batch-invariant).
GREEDY = {"temperature": 0.0, "max_new_tokens": 48, "concurrency": 1}
CAUSES = {
    "api": "vLLM was killed by SIGKILL",
    "engine": "its engine process (pid {engine}) died",
    "watchdog": "its watchdog was killed by SIGKILL",
}
LIMIT_S = 60  # from the kill to the stage's end
RUNNING = "vllm:num_requests_running"


@pytest.fixture(scope="module")
def served(generate_server: str) -> str:
    """The server of the reruns and the reference run, started as the stage's own (the
    session's: tests/conftest.py)."""
    return generate_server


@pytest.fixture(scope="module")
def reference(
    served: str, tiny_verifier_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> list[dict]:
    """The rows of an uninterrupted run."""
    root = tmp_path_factory.mktemp("reference")
    prepare_rows(root, N_ROWS)
    cwd = os.getcwd()
    os.chdir(root)
    try:
        generate.run(vllm_params(tiny_verifier_dir, server_url=served, **GREEDY))
    finally:
        os.chdir(cwd)
    return sorted(output_rows(root), key=lambda r: r["id"])


def _roles(tag: str) -> dict[str, psutil.Process]:
    """The tagged server's watchdog, API server and engine process."""
    found: dict[str, psutil.Process] = {}
    for pid in tagged_pids(tag):
        try:
            proc = psutil.Process(pid)
            argv = proc.cmdline()
        except psutil.NoSuchProcess:
            continue
        if "--watch" in argv:
            found["watchdog"] = proc
        elif "--run" in argv:
            found["api"] = proc
            engines = [c for c in proc.children() if "EngineCor" in c.name()]
            found.update(("engine", child) for child in engines)
    return found


def _kill_when(tag: str, which: str, ready: Callable[[], bool], killed: dict) -> threading.Thread:
    """Once `ready()`, SIGKILL the tagged server's `which`; `killed` gets the time and pids."""

    def run() -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            roles = _roles(tag)
            if len(roles) == 3 and ready():
                killed.update({"at": time.monotonic()} | {r: p.pid for r, p in roles.items()})
                os.kill(roles[which].pid, signal.SIGKILL)
                return
            time.sleep(0.1)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _check_line(message: str, which: str, killed: dict, log: Path, hint: str) -> None:
    assert "at" in killed, "the server was never killed"
    elapsed = time.monotonic() - killed["at"]
    assert elapsed < LIMIT_S, f"the stage ended {elapsed:.0f} s after the kill"
    cause = CAUSES[which].format(engine=killed["engine"])
    assert message.startswith("vLLM server http://127.0.0.1:"), message
    assert f" stopped: {cause}" in message and f" (log {log}: " in message, message
    assert message.endswith(hint) and "\n" not in message, message


@pytest.mark.vllm
# The engine killed under generate, the API server under evaluate: a real server start costs
# ~30 s of the suite; every kill of each stage (the watchdog's too) is unit-tested on the
# stand-in with vLLM's process tree (tests/unit/serving/test_server_watch.py).
@pytest.mark.parametrize("which", ["engine"])
def test_generate_ends_in_seconds_naming_the_server_and_a_rerun_finishes_the_rows(
    tmp_path: Path,
    tiny_verifier_dir: Path,
    served: str,
    reference: list[dict],
    monkeypatch,
    which: str,
) -> None:
    monkeypatch.chdir(tmp_path)
    tag = uuid.uuid4().hex
    monkeypatch.setenv(TAG_VAR, tag)  # the stage's server inherits it
    prepare_rows(tmp_path, N_ROWS)
    journal = paths.SCRATCH / "generate/done.jsonl"

    def journaled() -> list[dict]:
        return resume.Journal(journal).read() if journal.is_file() else []

    killed: dict = {}
    _kill_when(tag, which, lambda: len(journaled()) >= 2, killed)
    with pytest.raises(ServerError) as raised:
        generate.run(vllm_params(tiny_verifier_dir, **GREEDY))
    _check_line(
        str(raised.value),
        which,
        killed,
        generate.SERVER_LOG,
        "rerun to resume: finished rows are kept",
    )
    assert wait_none_tagged(tag, 30) == [], "the server's processes outlived the stage"
    assert 2 <= len(journaled()) < N_ROWS

    generate.run(vllm_params(tiny_verifier_dir, server_url=served, **GREEDY))  # the rerun
    rows = sorted(output_rows(tmp_path), key=lambda r: r["id"])
    assert rows == reference


def _serving(tag: str) -> Callable[[], bool]:
    """True once the tagged server answers /health and has a request running."""

    def ready() -> bool:
        api = _roles(tag).get("api")
        if api is None:
            return False
        ports = [c.laddr.port for c in api.net_connections("tcp") if c.status == "LISTEN"]
        key = _key(api.pid)
        key = {"Authorization": f"Bearer {key}"} if key else {}
        for port in ports:
            try:
                text = requests.get(f"http://127.0.0.1:{port}/metrics", headers=key, timeout=2)
            except requests.RequestException:
                continue
            running = [
                x for x in text.text.splitlines() if x.startswith("vllm:num_requests_running")
            ]
            if any(float(x.rsplit(" ", 1)[1]) > 0 for x in running):
                return True
        return False

    return ready


def _key(pid: int) -> str | None:
    """The API key the server holds, if it has one (evaluate's servers have none)."""
    try:
        return server_key(pid)
    except StopIteration:
        return None


@pytest.mark.vllm
@pytest.mark.parametrize("which", ["api"])
def test_evaluates_online_pass_ends_in_seconds_naming_the_server(
    tmp_path: Path, tiny_verifier_dir: Path, monkeypatch, which: str
) -> None:
    monkeypatch.chdir(tmp_path)
    tag = uuid.uuid4().hex
    monkeypatch.setenv(TAG_VAR, tag)
    rows = [
        {"id": f"v{i}", "messages": [{"role": "user", "content": f"Tell me about {i}."}]}
        for i in range(8)
    ]
    atomic.write_jsonl(paths.PREPARED / "val.jsonl", rows)
    params = Params.model_validate(
        {
            "verifier": {"path": str(tiny_verifier_dir)},
            "evaluate": {"speedup_rounds": 0, "max_new_tokens": 256, "concurrency": 1},
        }
    )
    killed: dict = {}
    _kill_when(tag, which, _serving(tag), killed)
    work = tmp_path / "work"
    with pytest.raises(ServerDown) as raised:
        evaluate.run_online(params, drafter_dir=tmp_path / "drafter", work=work)
    _check_line(str(raised.value), which, killed, work / "vllm-baseline.log", evaluate.RERUN_HINT)
    assert wait_none_tagged(tag, 30) == [], "the server's processes outlived the stage"
