"""extract survives SIGKILL: the rerun extracts only what the journal lacks, same bytes as one run.

The stage runs as `eagle3 extract` in a subprocess (hf backend, the tiny verifier) in a temp dir
laid out like the repo, is SIGKILLed once its journal shows progress, and is run again.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from extract_workdir import fake_backend, load_params, make_workdir, store_hashes

from eagle3_pipeline.core import resume
from eagle3_pipeline.stages import extract
from eagle3_pipeline.store import format as store

EAGLE3 = str(Path(sys.executable).with_name("eagle3"))


def _run_cli(cwd: Path) -> str:
    done = subprocess.run(
        [EAGLE3, "extract"], cwd=cwd, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.mark.slow
def test_sigkill_then_rerun_finishes_the_rest_with_identical_bytes(
    tiny_verifier_dir: Path, tmp_path: Path
) -> None:
    n, budget = 120, 240
    prompts = make_workdir(tmp_path / "ref", tiny_verifier_dir, n, budget)
    make_workdir(tmp_path / "run", tiny_verifier_dir, n, budget)
    batches = extract.token_budget_batches({s: len(p) for s, p in prompts.items()}, budget)
    biggest = max(len(b) for b in batches)
    assert len(batches) > 30  # enough batches that the kill lands mid-run

    _run_cli(tmp_path / "ref")

    work = tmp_path / "run"
    journal = work / "data/.work/extract" / extract.JOURNAL
    proc = subprocess.Popen(
        [EAGLE3, "extract"], cwd=work, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if journal.exists() and journal.read_bytes().count(b"\n") >= 5:
            break
        time.sleep(0.01)
    assert proc.poll() is None, "extract ended before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()

    journaled = {e["id"] for e in resume.Journal(journal).read()}
    on_disk = {p.name.removesuffix(".safetensors") for p in journal.parent.glob("*.safetensors")}
    assert 0 < len(journaled) < n and journaled <= on_disk
    assert len(on_disk - journaled) <= biggest  # at most the batch in flight is lost
    assert not (work / "data/hidden_states").exists()  # nothing half-published

    out = _run_cli(work)
    redo = int(re.search(r"(\d+) samples to extract", out).group(1))
    assert redo == n - len(journaled)  # nothing journaled is extracted again
    assert store_hashes(work) == store_hashes(tmp_path / "ref")
    scratch = journal.parent
    assert not list(scratch.glob("*.safetensors")) and not list(scratch.glob("entries*.jsonl"))
    assert not list(scratch.glob(".*.tmp"))


def test_damaged_scratch_file_is_extracted_again(
    tiny_verifier_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """A journaled file truncated or altered afterwards is re-extracted, never published."""
    make_workdir(tmp_path, tiny_verifier_dir, 30, 200)
    monkeypatch.chdir(tmp_path)
    params = load_params(tmp_path)
    calls: list[int] = []
    monkeypatch.setattr(extract, "open_backend", fake_backend(calls))
    extract.run(params, shard=(0, 2))  # scratch work that a later run reuses
    scratch = Path("data/.work/extract")
    entries = resume.Journal(scratch / extract.journal_name((0, 2))).read()
    truncated, altered = scratch / entries[0]["file"], scratch / entries[-1]["file"]
    truncated.write_bytes(truncated.read_bytes()[:100])
    data = bytearray(altered.read_bytes())
    data[-1] ^= 1
    altered.write_bytes(bytes(data))
    capsys.readouterr()
    extract.run(params)
    log = capsys.readouterr().out
    assert f"{truncated}: does not match its journal entry" in log
    assert f"{altered}: does not match its journal entry" in log
    manifest = store.read_manifest(Path("data/hidden_states"))
    assert manifest["num_samples"] == 30
    for entry in manifest["samples"].values():
        path = Path("data/hidden_states") / entry["file"]
        assert store.check_file(path.read_bytes(), entry, store.layout_of(manifest), None) == []


def test_preflight_refuses_when_the_disk_is_too_small(
    tiny_verifier_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from collections import namedtuple

    from eagle3_pipeline.core.errors import StoreError

    prompts = make_workdir(tmp_path, tiny_verifier_dir, 20, 200, dtype="fp8")
    monkeypatch.chdir(tmp_path)
    params = load_params(tmp_path)
    tokens = sum(len(p) for p in prompts.values())
    per_token = 4 * 64 + 4 * 4 + 16  # fp8 values + fp32 scale per layer + token id and mask
    need = tokens * per_token + params.extract.disk_headroom_gb * 1e9
    usage = namedtuple("usage", "total used free")
    calls: list[int] = []
    monkeypatch.setattr(extract, "open_backend", fake_backend(calls))
    monkeypatch.setattr(extract.shutil, "disk_usage", lambda _p: usage(0, 0, int(need) - 1))
    with pytest.raises(StoreError) as err:
        extract.run(params)
    msg = str(err.value)
    assert f"{need / 1e9:,.1f} GB" in msg and "free" in msg and "data/.work/extract" in msg
    assert "store_dtype: fp8" in msg and "\n" not in msg
    assert calls == [] and not Path("data/hidden_states").exists()
    monkeypatch.setattr(extract.shutil, "disk_usage", lambda _p: usage(0, 0, int(need) + 1))
    extract.run(params)
    assert store.read_manifest(Path("data/hidden_states"))["num_tokens"] == tokens


def test_batch_n_is_written_while_batch_n_plus_1_is_computed(
    tiny_verifier_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writer holds batch 1's files until the backend has started batch 2: were the two
    sequential, the run would wait on itself and time out."""
    import threading

    make_workdir(tmp_path, tiny_verifier_dir, 12, 200)
    monkeypatch.chdir(tmp_path)
    calls: list[int] = []
    second_started = threading.Event()
    fake = fake_backend(calls)

    def open_backend(*args, **kwargs):
        compute = fake(*args, **kwargs).__enter__()

        def run_batch(batch):
            if calls:
                second_started.set()
            return compute(batch)

        return contextlib.nullcontext(run_batch)

    real_write = extract.write_batch
    writes: list[bool] = []

    def write_batch(*args, **kwargs):
        if not writes:
            writes.append(second_started.wait(timeout=30))
        return real_write(*args, **kwargs)

    monkeypatch.setattr(extract, "open_backend", open_backend)
    monkeypatch.setattr(extract, "write_batch", write_batch)
    extract.run(load_params(tmp_path))
    assert len(calls) >= 2 and writes == [True]
    assert store.read_manifest(Path("data/hidden_states"))["num_samples"] == 12
