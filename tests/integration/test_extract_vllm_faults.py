"""vLLM's connector on a disk that fills: extract ends at once with the OS's reason, not after
vllm.ready_timeout_s blaming a busy machine. Real vLLM, real ENOSPC (a tmpfs where the connector
writes); where this machine cannot mount, tests/unit/stages/test_extract_faults.py injects it."""

from __future__ import annotations

import contextlib
import subprocess
import time
from pathlib import Path

import pytest
from extract_fixtures import extract_params, write_tokenized
from small_fs import mount_tmpfs

from eagle3_pipeline.core import disk
from eagle3_pipeline.stages import extract


@pytest.mark.vllm
def test_connector_write_failure_ends_extract_at_once(
    tiny_verifier_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    write_tokenized(tmp_path, {"train": [40, 50, 60], "val": [30]}, 1024, prompt_tokens=2)
    params = extract_params(tiny_verifier_dir, "vllm", [2, 4, 5], 8, max_tokens_per_batch=200)
    params.extract.disk_headroom_gb = 0.0
    real_open = extract.open_backend
    mounts: list[Path] = []
    ready: list[float] = []

    @contextlib.contextmanager
    def on_a_tiny_disk(backend, engine, layer_ids, work):
        target = work  # the folder vLLM's connector writes into
        if not mount_tmpfs(target, "16k"):
            pytest.skip("cannot mount a tmpfs here (needs root); the unit test injects ENOSPC")
        mounts.append(target)
        with real_open(backend, engine, layer_ids, work) as run_batch:
            ready.append(time.monotonic())
            yield run_batch

    monkeypatch.setattr(extract, "open_backend", on_a_tiny_disk)
    try:
        with pytest.raises(disk.DiskError) as err:
            extract.run(params)
        waited = time.monotonic() - ready[0]
    finally:
        for m in mounts:
            subprocess.run(["umount", "-l", str(m)], check=False)
    msg = str(err.value)
    print(f"error {waited:.1f} s after the engine was ready: {msg}")
    assert waited < 30 < params.vllm.ready_timeout_s
    assert "[Errno 28] No space left on device" in msg and "(tmpfs on tmpfs)" in msg
    assert not Path("data/hidden_states").exists()
