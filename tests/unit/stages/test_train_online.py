"""The `train` stage in online mode against a replaying server (tests/helpers/replay_server.py).

The server replays the synthetic store's own hidden states, so an online run must train the very
drafter the store run trains (same samples, same steps, same weights); each fault must end the
stage non-zero with one line naming the sample or the server, before the first step where the
server is wrong, and within the configured bound where it dies. The refusals run the CLI's `main`
in the test process (`in_this_process`: seconds, not a new process's imports); the training
runs, a killed run and a dying server's run are processes of their own. Real vLLM serving online
mode is tested end to end in tests/e2e/test_online_e2e.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import yaml
from replay_server import ReplayServer
from safetensors.torch import load_file
from train_workspace import (
    build_workspace,
    checkpoints,
    kill_during_epoch_2,
    run_stage,
    stage_command,
    stage_env,
)

from eagle3_pipeline import cli
from eagle3_pipeline.serving.chat import API_KEY_VAR
from eagle3_pipeline.store import format as store

pytestmark = pytest.mark.slow
TRAIN = {"epochs": 2, "keep_last": 1}
FAST = {"request_timeout_s": 5, "max_retries": 1, "round_trip_retries": 0}
KEY = "test-online-key-3f9c"


def _states(root: Path) -> dict[tuple[int, ...], torch.Tensor]:
    """Every stored sample's hidden states, keyed by its token ids (what the server gets)."""
    manifest = store.read_manifest(root / "data/hidden_states")
    out = {}
    for entry in manifest["samples"].values():
        t = store.read_sample(root / "data/hidden_states", entry)
        out[tuple(t["token_ids"].tolist())] = t["hidden_states"]
    return out


def _go_online(root: Path, url: str, **online: object) -> None:
    """Params to online mode, and the store cut to the val samples, as extract leaves it."""
    params = yaml.safe_load((root / "params.yaml").read_text())
    params["train"] |= {"hidden_states": "online", "online": {"endpoint": url, **FAST, **online}}
    (root / "params.yaml").write_text(yaml.safe_dump(params))
    store_dir = root / "data/hidden_states"
    manifest = store.read_manifest(store_dir)
    val = {
        json.loads(r)["id"] for r in (root / "data/tokenized/val.jsonl").read_text().splitlines()
    }
    for sid, entry in list(manifest["samples"].items()):
        if sid not in val:
            (store_dir / entry["file"]).unlink()
            del manifest["samples"][sid]
    store.write_manifest(store_dir, store.layout_of(manifest), manifest["samples"])


def _workspace(tmp_path: Path, name: str, verifier: Path) -> Path:
    return build_workspace(tmp_path / name, verifier, n_train=16, train=TRAIN)


def _error_line(proc: subprocess.CompletedProcess) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode != 0 and lines, proc.stdout[-2000:] + proc.stderr[-3000:]
    return lines[-1]


@pytest.fixture
def in_this_process(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> Iterator[Callable[[Path], subprocess.CompletedProcess]]:
    """`eagle3 train` run by the CLI's own `main` in this process, for the refusals (a wrong
    server before the first step, a bad sample at its step): the same code as the command,
    without a new process importing speculators and torch (~18 s each on 2 cores). The
    environment the stage sets is put back after."""
    saved = dict(os.environ)
    monkeypatch.delenv(API_KEY_VAR, raising=False)

    def run(root: Path) -> subprocess.CompletedProcess:
        monkeypatch.chdir(root)
        capsys.readouterr()
        rc = cli.main(["train", "--params", "params.yaml"])
        out = capsys.readouterr()
        return subprocess.CompletedProcess([], rc, out.out, out.err)

    yield run
    os.environ.clear()
    os.environ.update(saved)


def _weights(root: Path) -> dict[str, torch.Tensor]:
    return load_file(str(root / "models/trained/final/model.safetensors"))


@pytest.fixture(scope="module")
def store_run(tmp_path_factory: pytest.TempPathFactory, tiny_verifier_dir: Path) -> Path:
    root = _workspace(tmp_path_factory.mktemp("store"), "ws", tiny_verifier_dir)
    run_stage(root)
    return root


@pytest.fixture(scope="module")
def online_run(tmp_path_factory: pytest.TempPathFactory, tiny_verifier_dir: Path) -> tuple:
    """A server that wants a key, given in EAGLE3_VLLM_API_KEY: the pre-flight probe and
    speculators' own dataloader (patched: it hard-codes "EMPTY") must both present it."""
    root = _workspace(tmp_path_factory.mktemp("online"), "ws", tiny_verifier_dir)
    served = ReplayServer(_states(root), root / "served", str(tiny_verifier_dir), api_key=KEY)
    with served as server:
        _go_online(root, server.url)
        proc = subprocess.run(
            stage_command(),
            cwd=root,
            env=stage_env() | {API_KEY_VAR: KEY},
            capture_output=True,
            text=True,
        )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert server.refused == 0
    out = proc.stdout + proc.stderr
    assert KEY not in out  # in no log line
    return root, out, server.requests


def test_a_server_wanting_a_key_the_run_lacks_is_refused_naming_the_variable(
    tmp_path: Path, tiny_verifier_dir: Path, in_this_process: Callable
) -> None:
    root = _workspace(tmp_path, "ws", tiny_verifier_dir)
    served = ReplayServer(_states(root), root / "served", str(tiny_verifier_dir), api_key=KEY)
    with served as server:
        _go_online(root, server.url)
        proc = in_this_process(root)  # no EAGLE3_VLLM_API_KEY
    line = _error_line(proc)
    assert server.url in line and API_KEY_VAR in line and "401" in line, line
    assert server.requests == 0 and server.refused == 1  # refused on the model list


def test_online_trains_the_store_runs_drafter(store_run: Path, online_run: tuple) -> None:
    root, out, requests = online_run
    n_train, n_val = 16, 6
    # Every train row once per epoch from the server; the stored val rows from disk.
    assert requests == 1 + TRAIN["epochs"] * n_train, out  # 1: the pre-flight probe
    assert "server checked on sample s016" in out
    assert not list((root / "served").glob("*.safetensors")), "served files must be deleted"
    stored = store.read_manifest(root / "data/hidden_states")["samples"]
    assert len(stored) == n_val
    a, b = _weights(store_run), _weights(root)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.mark.parametrize("fault", ["missing", "truncated", "nan"])
def test_a_bad_sample_is_refused_by_name(
    tmp_path: Path, tiny_verifier_dir: Path, fault: str, in_this_process: Callable
) -> None:
    root = _workspace(tmp_path, "ws", tiny_verifier_dir)
    served = ReplayServer(
        _states(root), root / "served", str(tiny_verifier_dir), fault=fault, fault_after=3
    )
    with served as server:
        _go_online(root, server.url)
        proc = in_this_process(root)
    line = _error_line(proc)
    assert line.startswith("error: hidden states of sample s0"), line
    assert server.url in line
    assert {"missing": "Failed to load", "truncated": "Safetensor", "nan": "non-finite"}[
        fault
    ] in line, line
    assert "\n" not in line


@pytest.mark.parametrize("fault", ["other_model", "fewer_layers"])
def test_a_server_of_another_model_is_refused_before_the_first_step(
    tmp_path: Path, tiny_verifier_dir: Path, fault: str, in_this_process: Callable
) -> None:
    root = _workspace(tmp_path, "ws", tiny_verifier_dir)
    served = ReplayServer(
        _states(root), root / "served", str(tiny_verifier_dir), fault=fault, model_root="/else"
    )
    with served as server:
        _go_online(root, server.url)
        proc = in_this_process(root)
    line = _error_line(proc)
    assert f"'{tiny_verifier_dir}' (root /else)" in line, line
    assert ("differ from the store's" if fault == "other_model" else "[30, 3,") in line, line
    assert "epoch 0 step" not in proc.stdout
    assert not (checkpoints(root) / "0").exists()


def test_a_server_under_another_name_is_refused_naming_both(
    tmp_path: Path, tiny_verifier_dir: Path, in_this_process: Callable
) -> None:
    root = _workspace(tmp_path, "ws", tiny_verifier_dir)
    with ReplayServer(_states(root), root / "served", "org/other-model") as server:
        _go_online(root, server.url)
        proc = in_this_process(root)
    line = _error_line(proc)
    assert "'org/other-model'" in line and f"not the verifier {tiny_verifier_dir}" in line, line
    assert server.requests == 0  # refused on the model list, before any sample


def test_a_dying_server_ends_the_stage_within_the_bound(
    tmp_path: Path, tiny_verifier_dir: Path
) -> None:
    root = _workspace(tmp_path, "ws", tiny_verifier_dir)
    server = ReplayServer(_states(root), root / "served", str(tiny_verifier_dir))
    with server:
        _go_online(root, server.url)
        proc = subprocess.Popen(
            stage_command(),
            cwd=root,
            env=stage_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("[train] epoch 0 step 2"):
                break
        server.stop()
        t0 = time.monotonic()
        out, err = proc.communicate(timeout=120)
    waited = time.monotonic() - t0
    # Bound: (round trips 1) x (2 attempts x 5 s timeout + 2 s backoff) = 12 s, plus exit.
    assert waited < 60, waited
    line = _error_line(subprocess.CompletedProcess([], proc.returncode, out, err))
    assert server.url in line and "Connection" in line, line


def test_sigkill_mid_epoch_resumes_exactly(
    tmp_path: Path, tiny_verifier_dir: Path, online_run: tuple
) -> None:
    root = _workspace(tmp_path, "ws", tiny_verifier_dir)
    with ReplayServer(_states(root), root / "served", str(tiny_verifier_dir)) as server:
        _go_online(root, server.url)
        kill_during_epoch_2(root)
        out = run_stage(root)
    assert "resuming after epoch 0" in out
    a, b = _weights(online_run[0]), _weights(root)
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_two_processes_share_the_rows_online(tmp_path: Path, tiny_verifier_dir: Path) -> None:
    """torchrun ranks each ask the server for their own rows: every train row once per epoch."""
    root = build_workspace(
        tmp_path / "ws", tiny_verifier_dir, n_train=16, train=TRAIN | {"nproc": 2}
    )
    with ReplayServer(_states(root), root / "served", str(tiny_verifier_dir)) as server:
        _go_online(root, server.url)
        out = run_stage(root)
    assert "launching 2 processes (ddp): torchrun" in out
    train_ids = {
        tuple(json.loads(line)["input_ids"])
        for line in (root / "data/tokenized/train.jsonl").read_text().splitlines()
    }
    asked = server.asked[1:]  # after the pre-flight probe
    assert set(asked) == train_ids  # every train row asked, by one rank or the other
    assert len(asked) <= TRAIN["epochs"] * (len(train_ids) + 2), len(asked)
    assert (root / "models/trained/final/model.safetensors").is_file()


def test_a_family_branch_trains_online_as_from_the_store(
    tmp_path: Path, tiny_verifier_dir: Path
) -> None:
    """`family@NAME` (here DFlash, one pass per draft) runs train's online path too: the branch
    asks the server for every train row and ends with the weights its store run trains."""
    branch = {"d": {"name": "dflash", "block_size": 3, "num_layers": 1, "mask_token_id": 1}}
    roots = []
    for name in ("store", "online"):
        root = build_workspace(tmp_path / name, tiny_verifier_dir, n_train=8, n_val=2, train=TRAIN)
        params = yaml.safe_load((root / "params.yaml").read_text())
        (root / "params.yaml").write_text(yaml.safe_dump(params | {"families": branch}))
        roots.append(root)
    command = [*stage_command(), "--family", "d"]
    store_root, online_root = roots
    proc = subprocess.run(command, cwd=store_root, env=stage_env(), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    served = ReplayServer(_states(online_root), online_root / "served", str(tiny_verifier_dir))
    with served as server:
        _go_online(online_root, server.url)
        proc = subprocess.run(
            command, cwd=online_root, env=stage_env(), capture_output=True, text=True
        )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert server.requests == 1 + TRAIN["epochs"] * 8, proc.stdout[-3000:]
    assert "drafter dflash" in proc.stdout + proc.stderr
    final = Path("models/families/d/final/model.safetensors")
    a, b = load_file(str(store_root / final)), load_file(str(online_root / final))
    assert a.keys() == b.keys() and any("mask" in k or "layers" in k for k in a)
    for name in a:
        assert torch.equal(a[name], b[name]), name
