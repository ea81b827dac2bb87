"""online_training/source.py's server: one the stage started that stops while training waits on it
interrupts the training at once and ends the stage in one line naming the server and the cause
(against a stand-in with vLLM's process tree, tests/helpers/stand_in_server.py)."""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path

import pytest
import stand_in_server as stand_in

from eagle3_pipeline.config.params import Params
from eagle3_pipeline.core.errors import ServerDown
from eagle3_pipeline.online_training import source as online
from eagle3_pipeline.verifier.identity import read_verifier


def test_a_stopped_server_interrupts_training_and_says_why(
    tmp_path: Path, tiny_verifier_dir: Path, monkeypatch
) -> None:
    stand_in.use_stand_in(monkeypatch)
    params = Params.model_validate({"verifier": {"path": str(tiny_verifier_dir)}})
    # A SIGINT handler left behind that returns without raising (what a finished library's may
    # do) must not swallow the interruption.
    left_behind = signal.signal(signal.SIGINT, lambda signum, frame: None)
    t0 = time.monotonic()
    try:
        with (
            pytest.raises(ServerDown) as raised,
            online.online_source(
                params.train.online,
                read_verifier(params.verifier),
                params.vllm,
                [2, 4, 5, 8],
                tmp_path,
            ) as source,
        ):
            stand_in.kill(source.endpoint.removesuffix("/v1"), "engine")
            time.sleep(60)  # training, waiting on the server: interrupted, not waited out
    finally:
        signal.signal(signal.SIGINT, left_behind)
    assert time.monotonic() - t0 < 40
    assert re.fullmatch(
        r"vLLM server http://127\.0\.0\.1:\d+ stopped: its engine process \(pid \d+\) died "
        r"\(log .*vllm-online\.log: .*\); rerun to resume from the last complete checkpoint",
        str(raised.value),
    ), raised.value
