"""extract under real-run faults: a disk that fills, vLLM's connector failing to write, scratch
and store on different filesystems, ids no file name could hold.

Where this machine allows a mount (root), the faults are real: a small tmpfs. Elsewhere the same
OS error is injected, so every case runs in CI.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import time
from pathlib import Path

import pytest
import torch
from extract_workdir import fake_backend, load_params, make_workdir
from small_fs import enospc, resize, small_tmpfs

from eagle3_pipeline.core import atomic, disk, resume
from eagle3_pipeline.core.errors import StoreError
from eagle3_pipeline.serving import hidden_states
from eagle3_pipeline.stages import extract
from eagle3_pipeline.store import format as store

N = 40


def _fill_after_preflight(monkeypatch: pytest.MonkeyPatch, work: Path, leave: int) -> None:
    """Another writer fills the disk once the pre-flight passed (it cannot foresee that)."""
    real = extract.preflight

    def preflight(*args, **kwargs) -> str:
        line = real(*args, **kwargs)
        free = os.statvfs(work).f_bavail * os.statvfs(work).f_frsize
        (work / "ballast").write_bytes(b"\0" * max(free - leave, 0))
        return line

    monkeypatch.setattr(extract, "preflight", preflight)


@pytest.mark.parametrize("how", ["tmpfs", "injected"])
def test_disk_full_ends_at_once_with_the_reason_and_a_rerun_resumes(
    how: str, tiny_verifier_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    make_workdir(tmp_path, tiny_verifier_dir, N, 200)
    monkeypatch.chdir(tmp_path)
    params = load_params(tmp_path)
    params.extract.disk_headroom_gb = 0.0
    monkeypatch.setattr(extract, "open_backend", fake_backend([]))
    work = tmp_path / "data/.work"
    real_write = store._write_unsynced
    with small_tmpfs(work, "8m") if how == "tmpfs" else contextlib.nullcontext(False) as mounted:
        if how == "tmpfs" and not mounted:
            pytest.skip("cannot mount a tmpfs here (needs root); the injected case runs instead")
        if mounted:
            _fill_after_preflight(monkeypatch, work, leave=300_000)
        else:
            written = []

            def failing(path: Path, data: bytes) -> None:
                written.append(path)
                if len(written) > 12:
                    raise enospc(path)
                real_write(path, data)

            monkeypatch.setattr(store, "_write_unsynced", failing)
        t0 = time.monotonic()
        with pytest.raises(disk.DiskError) as err:
            extract.run(params)
        assert time.monotonic() - t0 < 30  # seconds, not vllm.ready_timeout_s
        msg = str(err.value)
        assert "[Errno 28] No space left on device" in msg and "\n" not in msg
        assert re.search(r"writing data/\.work/extract/\S+ failed", msg)  # which file
        assert "free of" in msg and re.search(r"about [\d.,]+ [MG]B still to write", msg)
        if mounted:
            assert f"mount {work} (tmpfs on tmpfs)" in msg
        scratch = Path("data/.work/extract")
        assert not Path("data/hidden_states").exists()  # nothing published
        assert not list(scratch.glob(".*.tmp"))  # nothing half-written left behind
        journaled = {e["id"] for e in resume.Journal(scratch / extract.JOURNAL).read()}
        assert 0 < len(journaled) < N

        if mounted:  # room again
            monkeypatch.undo()
            monkeypatch.chdir(tmp_path)
            monkeypatch.setattr(extract, "open_backend", fake_backend([]))
            (work / "ballast").unlink()
            resize(work, "64m")
        else:
            monkeypatch.setattr(store, "_write_unsynced", real_write)
        capsys.readouterr()
        extract.run(params)
        redo = int(re.search(r"(\d+) samples to extract", capsys.readouterr().out).group(1))
        assert redo == N - len(journaled)  # what was complete is kept
        assert store.read_manifest(Path("data/hidden_states"))["num_samples"] == N


@pytest.mark.vllm  # imports vLLM's connector module (~10 s)
def test_a_failed_connector_write_is_reported_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from eagle3_pipeline.in_vllm import cpu_hs_connector

    assert hidden_states.FAILED_SUFFIX == cpu_hs_connector.FAILED_SUFFIX  # writer and reader
    target = tmp_path / "vllm"
    with small_tmpfs(target, "64k") as mounted:
        target.mkdir(parents=True, exist_ok=True)
        path = str(target / "req-1.safetensors")
        lock = os.open(path + ".lock", os.O_CREAT | os.O_WRONLY, 0o644)
        tensors = {"hidden_states": torch.zeros(64, 4, 256), "token_ids": torch.arange(64)}
        if not mounted:  # what safetensors raises on a full disk

            def full(*_args) -> None:
                raise RuntimeError(
                    "Error while serializing: I/O error: No space left (os error 28)"
                )

            monkeypatch.setattr(cpu_hs_connector, "save_file", full)
        with pytest.raises(Exception, match=r"os error 28"):
            cpu_hs_connector.write_or_report(tensors, path, lock)
        assert os.listdir(target) == ["req-1.safetensors.failed-28"]  # no torn file, no .part

        eng = object.__new__(hidden_states.HiddenStateEngine)
        eng.write_timeout_s = 600.0
        t0 = time.monotonic()
        with pytest.raises(OSError) as err:
            eng._wait_written([path])
        assert time.monotonic() - t0 < 5 and err.value.errno == errno.ENOSPC


def test_a_connector_failure_ends_extract_with_the_mount_and_need(
    tiny_verifier_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What extract makes of the engine's error (the engine side: the test above)."""
    make_workdir(tmp_path, tiny_verifier_dir, 10, 200)
    monkeypatch.chdir(tmp_path)
    params = load_params(tmp_path)
    params.extract.disk_headroom_gb = 0.0
    vllm_dir = Path("data/.work/extract/vllm")

    def run_batch(batch: list[list[int]]) -> list[torch.Tensor]:
        vllm_dir.mkdir(parents=True, exist_ok=True)
        marker = vllm_dir / "req-0.safetensors.failed-28"
        marker.touch()
        raise hidden_states.write_failure(str(vllm_dir / "req-0.safetensors"))

    monkeypatch.setattr(
        extract, "open_backend", lambda *_a, **_kw: contextlib.nullcontext(run_batch)
    )
    with pytest.raises(disk.DiskError) as err:
        extract.run(params)
    msg = str(err.value)
    assert "req-0.safetensors failed: [Errno 28] No space left on device" in msg
    assert "free of" in msg and "still to write" in msg


@pytest.mark.parametrize("how", ["tmpfs", "injected"])
def test_scratch_on_another_filesystem_publishes_by_copy(
    how: str, tiny_verifier_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    make_workdir(tmp_path, tiny_verifier_dir, 20, 200)
    monkeypatch.chdir(tmp_path)
    params = load_params(tmp_path)
    params.extract.disk_headroom_gb = 0.0
    monkeypatch.setattr(extract, "open_backend", fake_backend([]))
    work = tmp_path / "data/.work"
    with small_tmpfs(work, "64m") if how == "tmpfs" else contextlib.nullcontext(False) as mounted:
        if how == "tmpfs" and not mounted:
            pytest.skip("cannot mount a tmpfs here (needs root); the injected case runs instead")
        if not mounted:

            def no_link(_src, _dst) -> None:
                raise OSError(errno.EXDEV, os.strerror(errno.EXDEV))

            monkeypatch.setattr(atomic.os, "link", no_link)
            monkeypatch.setattr(disk, "same_filesystem", lambda _a, _b: False)
        extract.run(params)
        log = capsys.readouterr().out
        assert "on different filesystems: publish copies and fsyncs every file" in log
        out = Path("data/hidden_states")
        manifest = store.read_manifest(out)
        assert manifest["num_samples"] == 20
        store.verify_hashes(out, manifest)
        assert not list(Path("data/.work/extract").glob("*.safetensors"))  # scratch emptied


def test_same_filesystem_says_so(
    tiny_verifier_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    make_workdir(tmp_path, tiny_verifier_dir, 5, 200)
    monkeypatch.chdir(tmp_path)
    params = load_params(tmp_path)
    params.extract.disk_headroom_gb = 0.0
    monkeypatch.setattr(extract, "open_backend", fake_backend([]))
    extract.run(params)
    assert "on one filesystem: publish by hardlink" in capsys.readouterr().out


def test_output_folder_as_a_mount_point_is_refused_before_work(
    tiny_verifier_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    make_workdir(tmp_path, tiny_verifier_dir, 5, 200)
    monkeypatch.chdir(tmp_path)
    calls: list[int] = []
    monkeypatch.setattr(extract, "open_backend", fake_backend(calls))
    with small_tmpfs(tmp_path / "data/hidden_states", "1m") as mounted:
        if not mounted:
            monkeypatch.setattr(extract.os.path, "ismount", lambda p: "hidden_states" in str(p))
        with pytest.raises(StoreError, match="is a mount point.*mount that filesystem at data"):
            extract.run(load_params(tmp_path))
    assert calls == []
