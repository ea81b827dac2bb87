"""online_training/served.py: a store-mode job starts no server; online, the server is up (and
checked) while the job trains, stopped after, and torchrun's workers read it from their
settings while a single process keeps the job's own."""

from __future__ import annotations

import contextlib
import dataclasses
import os

import pytest
from builders import train_job, train_params

from eagle3_pipeline.online_training import served as served_module
from eagle3_pipeline.online_training import source as online
from eagle3_pipeline.training.inputs import TrainJob
from eagle3_pipeline.training.online_backend import LOCAL_HOSTNAME_VAR

SERVER = online.OnlineSource("http://10.0.0.2:8000/v1", "the stand-in server")


def _job(**train) -> TrainJob:
    return train_job(train_params(**train))


@pytest.fixture
def server(monkeypatch) -> list[str]:
    """The server `served` starts, as a stand-in: what happened to it, in order."""
    events: list[str] = []

    @contextlib.contextmanager
    def online_source(o, verifier, vllm, layer_ids, work):
        events.append(f"up {layer_ids}")
        yield SERVER
        events.append("down")

    def check_and_log(settings, inputs, source, servers=1):
        events.append(f"checked {source.endpoint}")
        return {"vllm_endpoint": source.endpoint}

    monkeypatch.setattr(online, "online_source", online_source)
    monkeypatch.setattr(served_module, "check_and_log", check_and_log)
    monkeypatch.delenv(LOCAL_HOSTNAME_VAR, raising=False)
    return events


def test_a_store_job_trains_as_resolved_and_starts_no_server(server: list[str]) -> None:
    job = _job()
    with served_module.served(job) as s:
        assert s == served_module.Served(job.settings)
    assert server == []


@pytest.mark.parametrize("nproc", [1, 2])
def test_online_the_server_is_up_and_checked_while_the_job_trains(
    server: list[str], nproc: int
) -> None:
    job = _job(hidden_states="online", nproc=nproc)
    with served_module.served(job) as s:
        assert server == ["up [1, 2, 3]", f"checked {SERVER.endpoint}"]
        assert (s.source, s.flags, s.pools) == (SERVER, {"vllm_endpoint": SERVER.endpoint}, None)
        # torchrun's workers read the server from their settings; one process keeps the job's.
        workers = s.settings.train.online.endpoint
        assert workers == (SERVER.endpoint if nproc > 1 else None)
        assert dataclasses.replace(s.settings, train=job.train) == job.settings
    assert server[-1] == "down"


def test_a_mooncake_trainer_registers_with_the_address_params_give(
    server: list[str], monkeypatch
) -> None:
    online_params = {"backend": "mooncake", "mooncake": {"local_hostname": "10.0.0.7"}}
    job = _job(hidden_states="online", online=online_params)
    with served_module.served(job):
        assert os.environ[LOCAL_HOSTNAME_VAR] == "10.0.0.7"


def test_online_aux_ids_out_of_order_are_refused_before_a_server_starts(
    server: list[str],
) -> None:
    job = train_job(train_params(hidden_states="online"), aux=[2, 1])
    with pytest.raises(Exception, match="ascending"), served_module.served(job):
        pass
    assert server == []
