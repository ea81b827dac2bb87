"""serving/server_process.py's Watch: a server that stops serving (its API server, engine or
watchdog killed, or /health failing) is declared down within seconds, in one line naming the
server, the cause and its log; its requests in flight end at once and its clients send nothing
more; a server stopped on purpose is not a failure. Against a stand-in with vLLM's process tree
(tests/helpers/stand_in_server.py); against real vLLM: tests/integration/test_server_down.py."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import stand_in_server as stand_in

from eagle3_pipeline.core.errors import ServerDown
from eagle3_pipeline.serving import server as vllm_server
from eagle3_pipeline.serving import server_process
from eagle3_pipeline.serving.chat import ChatClient, RequestFailed, complete_all

BODY = {"model": "verifier", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
CAUSES = {
    "api": "stopped: vLLM was killed by SIGKILL",
    "engine": "stopped: its engine process (pid {pid}) died",
    "watchdog": "stopped: its watchdog was killed by SIGKILL",
}


def test_exit_causes_in_words() -> None:
    assert server_process.exit_cause(1) == "vLLM exited with code 1"
    assert server_process.exit_cause(137) == "vLLM was killed by SIGKILL"
    assert server_process.exit_cause(143) == "vLLM was killed by SIGTERM"
    assert server_process.exit_cause(-9) == "its watchdog was killed by SIGKILL"


def _chat_in_thread(client: ChatClient) -> tuple[threading.Thread, list]:
    got: list = []

    def ask() -> None:
        try:
            got.append(client.chat(BODY))
        except RequestFailed as exc:
            got.append(exc)

    thread = threading.Thread(target=ask, daemon=True)
    thread.start()
    return thread, got


@pytest.mark.parametrize("which", ["api", "engine", "watchdog"])
def test_a_killed_server_ends_its_requests_in_flight_in_seconds_with_the_cause(
    tmp_path: Path, monkeypatch, which: str
) -> None:
    stand_in.use_stand_in(monkeypatch)
    spec = stand_in.spec(tmp_path)
    with vllm_server.serve(spec) as url:
        client = ChatClient(url, timeout_s=600, max_retries=4)
        thread, got = _chat_in_thread(client)
        stand_in.wait_asked(spec.log_file)
        engine_pid = stand_in.processes(url)["engine"].pid
        t0 = time.monotonic()
        stand_in.kill(url, which)
        thread.join(30)
        elapsed = time.monotonic() - t0
        assert got and isinstance(got[0], RequestFailed), got
        failure = got[0]
        assert failure.down and failure.transient
        reason = str(failure)
        assert reason.startswith(f"vLLM server {url} {CAUSES[which].format(pid=engine_pid)}")
        assert f"(log {spec.log_file}: " in reason and "\n" not in reason
        assert elapsed < 10, f"the request ended {elapsed:.1f} s after the kill"
        assert server_process.down_reason(url) == reason
        assert client.down() == reason and not client.answers()
        with pytest.raises(RequestFailed, match="stopped: "):  # nothing more is sent
            client.chat(BODY)
    assert server_process.down_reason(url) is None  # its URL may serve another server later


def test_health_failing_in_a_row_is_a_server_down(tmp_path: Path, monkeypatch) -> None:
    stand_in.use_stand_in(monkeypatch, mode="sick")
    spec = stand_in.spec(tmp_path)
    seen: list[str] = []
    with vllm_server.serve(spec, on_down=seen.append) as url:
        thread, got = _chat_in_thread(ChatClient(url, timeout_s=600))
        thread.join(30)
        assert seen and seen[0].startswith(f"vLLM server {url} stopped: /health answered HTTP 503")
        assert isinstance(got[0], RequestFailed) and got[0].down  # ended, not left waiting


def test_a_server_stopped_on_purpose_is_not_down(tmp_path: Path, monkeypatch, capsys) -> None:
    stand_in.use_stand_in(monkeypatch)
    seen: list[str] = []
    with vllm_server.serve(stand_in.spec(tmp_path), on_down=seen.append) as url:
        time.sleep(2.5 * server_process.WATCH_INTERVAL_S)  # polls that find it serving
        assert server_process.down_reason(url) is None
    time.sleep(2.5 * server_process.WATCH_INTERVAL_S)
    assert seen == [] and server_process.down_reason(url) is None
    assert "stopped:" not in capsys.readouterr().err


def test_complete_all_raises_server_down_when_its_server_stops(tmp_path: Path, monkeypatch) -> None:
    stand_in.use_stand_in(monkeypatch)
    spec = stand_in.spec(tmp_path)
    outcomes: list = []
    with vllm_server.serve(spec) as url:
        client = ChatClient(url, timeout_s=600)
        threading.Timer(0.5, lambda: stand_in.kill(url, "api")).start()
        t0 = time.monotonic()
        with pytest.raises(ServerDown, match=f"^vLLM server {url} stopped: vLLM was killed"):
            complete_all(client, [(str(i), BODY) for i in range(4)], 2, outcomes.append)
        assert time.monotonic() - t0 < 10
    assert outcomes == []
