"""hs_connectors' `mooncake` backend, trainer side, for real: a Mooncake master on loopback,
the vLLM side played by another process (tests/helpers/mooncake_writer.py), TCP.

The trainer is built as speculators builds it: our params -> online_backend's flags ->
speculators' TrainConfig -> flat namespace -> the registered backend's from_train_args -> setup;
each sample is read from a vLLM-shaped response as its dataloader reads it (extract_output,
get_generated, check_hidden_states, delete). vLLM's connector itself needs an accelerator: not
run here.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from mooncake_master import Master, loopback_master, stop
from safetensors.torch import load_file

from eagle3_pipeline.config.training_params import MooncakeParams, OnlineParams
from eagle3_pipeline.training.online_backend import (
    LOCAL_HOSTNAME_VAR,
    backend_dests,
    mooncake_env,
    speculators_flags,
    split_backend_flags,
)

WRITER = Path(__file__).resolve().parents[2] / "helpers" / "mooncake_writer.py"
WRITER_TIMEOUT_S = 90.0
SETTINGS = MooncakeParams(
    master="10.1.2.3:50061",
    metadata_server="P2PHANDSHAKE",
    protocol="rdma",
    device="mlx5_0,mlx5_1",
    global_segment_gib=8.5,
    local_buffer_gib=1.25,
    local_hostname="10.1.2.4",
)
# What speculators needs besides the backend to resolve a config.
BASE = {"verifier_name_or_path": "verifier", "data_path": "data"}


def test_mooncake_flags_carry_every_setting() -> None:
    online = OnlineParams(backend="mooncake", mooncake=SETTINGS)
    assert speculators_flags(online) == {
        "hidden_states_backend": "mooncake",
        "mooncake_master": "10.1.2.3:50061",
        "mooncake_metadata_server": "P2PHANDSHAKE",
        "mooncake_protocol": "rdma",
        "mooncake_device": "mlx5_0,mlx5_1",
        "mooncake_global_segment_gib": 8.5,
        "mooncake_local_buffer_gib": 1.25,
    }
    assert mooncake_env(online) == {"MOONCAKE_LOCAL_HOSTNAME": "10.1.2.4"}


def test_file_backend_and_default_hostname_need_nothing_more() -> None:
    assert speculators_flags(OnlineParams(backend="file")) == {"hidden_states_backend": "fp8"}
    assert mooncake_env(OnlineParams(backend="file", mooncake=SETTINGS)) == {}
    assert mooncake_env(OnlineParams(backend="mooncake")) == {}


def test_flags_are_exactly_hs_connectors_train_args() -> None:
    from hs_connectors import MooncakeBackend

    parser = argparse.ArgumentParser()
    MooncakeBackend.add_train_args(parser)
    theirs = set(vars(parser.parse_args([])))
    ours = set(speculators_flags(OnlineParams(backend="mooncake"))) - {"hidden_states_backend"}
    assert ours == theirs, f"hs_connectors' mooncake train args: {sorted(theirs)}"
    assert theirs <= backend_dests()


@pytest.mark.slow  # imports speculators' config (10-15 s here)
def test_backend_flags_reach_the_trainer_only_as_backend_cli() -> None:
    from speculators.train.config import TrainConfig

    flags = BASE | speculators_flags(OnlineParams(backend="mooncake", mooncake=SETTINGS))
    cli, backend_cli = split_backend_flags(flags)
    assert set(backend_cli) == set(flags) - set(BASE) - {"hidden_states_backend"}
    resolved = TrainConfig.from_sources(cli=cli, backend_cli=backend_cli, argv=[]).flatten()
    assert {k: resolved[k] for k in flags} == flags
    # The trap split_backend_flags avoids: in `cli` they are dropped for the defaults.
    dropped = TrainConfig.from_sources(cli=flags, argv=[]).flatten()
    assert dropped["hidden_states_backend"] == "mooncake"
    assert dropped["mooncake_master"] == "127.0.0.1:50051"


@dataclass
class Session:
    master: Master
    transfer: Any  # hs_connectors' MooncakeTransfer, as speculators' dataloader holds it
    params: dict[str, dict]  # case -> kv_transfer_params, decoded from JSON as vLLM sends it
    kv_transfer_config: dict
    sent: dict[str, torch.Tensor]


def _read_line(proc: subprocess.Popen, timeout_s: float, log: Path) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.5)
        if ready:
            line = proc.stdout.readline()
            if line:
                return line
        if proc.poll() is not None:
            break
    tail = log.read_text(errors="replace")[-3000:]
    raise RuntimeError(f"mooncake writer gave no manifest in {timeout_s:.0f} s:\n{tail}")


def trainer_transfer(master: Master) -> Any:
    """The trainer's transfer exactly as `speculators train` makes it from our flags."""
    from hs_connectors import HiddenStatesBackend
    from speculators.train.config import TrainConfig

    online = OnlineParams(
        backend="mooncake",
        mooncake=MooncakeParams(
            master=master.address,
            global_segment_gib=1 / 16,
            local_buffer_gib=1 / 32,
            local_hostname="127.0.0.1",
        ),
    )
    cli, backend_cli = split_backend_flags(BASE | speculators_flags(online))
    config = TrainConfig.from_sources(cli=cli, backend_cli=backend_cli, argv=[])
    args = argparse.Namespace(**config.flatten())  # what speculators' trainer reads
    with pytest.MonkeyPatch.context() as mp:
        for key, value in mooncake_env(online).items():
            mp.setenv(key, value)
        backend = HiddenStatesBackend.registry[args.hidden_states_backend]
        transfer = backend.from_train_args(args, args.data_path)
    assert transfer.store.config.local_hostname == "127.0.0.1"
    assert transfer.store.config.master_server_address == master.address
    transfer.setup()  # what speculators' dataloader calls before its first request
    return transfer


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Session]:
    try:
        import mooncake.store  # noqa: F401
    except ImportError as e:  # hs_connectors would say "pip install", hiding the cause
        pytest.fail(
            f"mooncake.store does not load ({e}): the wheel needs the system's libibverbs.so.1, "
            "libnuma.so.1 and libcurl.so.4 (Debian: apt-get install libibverbs1 libnuma1 libcurl4)"
        )
    work = tmp_path_factory.mktemp("mooncake")
    log = work / "writer.log"
    with loopback_master(work) as master:
        env = dict(os.environ, **{LOCAL_HOSTNAME_VAR: "127.0.0.1"})
        with open(log, "wb") as err:
            writer = subprocess.Popen(
                [sys.executable, str(WRITER), master.address, str(work)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True, env=env,
                start_new_session=True,
            )  # fmt: skip
        transfer = None
        try:
            # The trainer connects while the writer imports torch (2 cores: overlap them).
            transfer = trainer_transfer(master)
            out = json.loads(_read_line(writer, WRITER_TIMEOUT_S, log))
            yield Session(
                master=master,
                transfer=transfer,
                params=out["params"],
                kv_transfer_config=out["kv_transfer_config"],
                sent=load_file(work / "sent.safetensors"),
            )
        finally:
            if transfer is not None and transfer.store.is_setup:
                transfer.store._store.close()
            if writer.stdin:
                writer.stdin.close()  # the writer then closes its store and exits
            try:
                writer.wait(10)
            except subprocess.TimeoutExpired:
                stop(writer)


def _exists(session: Session, key: str) -> int:
    return session.transfer.store._require_store().is_exist(key)


def _response(params: dict, token_ids: list[int]) -> Any:
    """vLLM's completion response to speculators' max_tokens=1 request, as the client parses it."""
    from openai.types import Completion

    return Completion.model_validate(
        {
            "id": "cmpl-0",
            "object": "text_completion",
            "created": 0,
            "model": "verifier",
            "choices": [
                {
                    "index": 0,
                    "text": "x",
                    "finish_reason": "length",
                    "logprobs": None,
                    "prompt_token_ids": token_ids,
                }
            ],
            "kv_transfer_params": params,
        }
    )


@pytest.mark.slow
def test_vllm_side_config_is_the_mooncake_connector(session: Session) -> None:
    config = session.kv_transfer_config
    assert config["kv_connector"] == "MooncakeHiddenStatesConnector"
    assert config["kv_connector_module_path"] == "hs_connectors.mooncake_hidden_states_connector"
    mooncake = config["kv_connector_extra_config"]["mooncake"]
    assert mooncake["master_server_address"] == session.master.address
    assert mooncake["local_hostname"] == "127.0.0.1"
    assert mooncake["protocol"] == "tcp"


@pytest.mark.slow
def test_trainer_reads_what_the_vllm_side_wrote_then_deletes_it(session: Session) -> None:
    from speculators.data_generation.offline import check_hidden_states
    from speculators.data_generation.vllm_client import extract_output

    token_ids = session.sent["token_ids"].tolist()
    handle, params = extract_output(_response(session.params["good"], token_ids), token_ids)
    assert handle == "cmpl-good-0"
    loaded = session.transfer.get_generated(params)
    assert set(loaded) == {"hidden_states", "token_ids"}
    for name, sent in session.sent.items():
        assert loaded[name].dtype == sent.dtype, name
        assert torch.equal(loaded[name], sent), name
    check_hidden_states(loaded, token_ids)

    session.transfer.delete(handle)
    assert _exists(session, handle) == 0
    session.transfer.delete(handle)  # a second delete (a retry's cleanup) is not an error
    with pytest.raises(TimeoutError, match=handle):
        session.transfer.store.get_sample(params, timeout=0.5)


@pytest.mark.slow
def test_missing_object_is_refused_naming_the_key(session: Session) -> None:
    params = session.params["missing"]
    # get_generated waits hs_connectors' default 120 s; the same call, bounded here.
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="cmpl-missing-0"):
        session.transfer.store.get_sample(params, timeout=1.0)
    assert time.monotonic() - t0 < 10


@pytest.mark.slow
def test_truncated_object_is_refused(session: Session) -> None:
    from hs_connectors.mooncake_store import MooncakeIntegrityError

    params = session.params["truncated"]
    expected = params["metadata"]["total_aligned_bytes"]
    # hs_connectors' message gives both sizes but not the key (speculators' warning names the
    # dataset index of the sample).
    with pytest.raises(MooncakeIntegrityError, match=f"size {expected // 2} .* size {expected}"):
        session.transfer.get_generated(params)
    session.transfer.delete(params["handle"])
    assert _exists(session, params["handle"]) == 0


@pytest.mark.slow
def test_nan_refused_by_the_vllm_side_reaches_the_trainer_naming_the_key(
    session: Session,
) -> None:
    from hs_connectors.mooncake_store import MooncakeIntegrityError

    params = session.params["nan_refused"]
    with pytest.raises(MooncakeIntegrityError) as err:
        session.transfer.get_generated(params)
    assert "producer error for key=cmpl-nan-refused-0:error" in str(err.value)
    assert "Non-finite producer tensor 'hidden_states'" in str(err.value)
    assert "nan_count=1" in str(err.value)
    assert _exists(session, "cmpl-nan-refused-0") == 0  # only the marker was published
    session.transfer.delete(params["handle"])  # removes the marker too
    assert _exists(session, "cmpl-nan-refused-0:error") == 0


@pytest.mark.slow
def test_nan_in_a_stored_object_is_refused_by_speculators_check(session: Session) -> None:
    from speculators.data_generation.offline import check_hidden_states

    params = session.params["nan_stored"]
    loaded = session.transfer.get_generated(params)  # hs_connectors reads it as it is
    assert torch.isnan(loaded["hidden_states"]).sum() == 1
    with pytest.raises(ValueError, match="non-finite"):
        check_hidden_states(loaded, session.sent["token_ids"].tolist())
    session.transfer.delete(params["handle"])
