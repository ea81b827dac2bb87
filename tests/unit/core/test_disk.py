"""Disk faults in the user's terms: the OS's reason, the mount, free and needed space."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch
from small_fs import enospc, small_tmpfs

from eagle3_pipeline.core import disk


def test_a_full_disk_names_reason_mount_free_and_need(tmp_path: Path) -> None:
    target = tmp_path / "small"
    with small_tmpfs(target, "256k") as mounted:
        with pytest.raises(disk.DiskError) as err, disk.guard("extract", target, lambda: 5e9):
            if mounted:  # a real ENOSPC from the kernel
                (target / "f").write_bytes(os.urandom(1 << 20))
            else:
                raise enospc(target / "f")
        msg = str(err.value)
        assert "[Errno 28] No space left on device" in msg and str(target) in msg
        assert "free of" in msg and "5.0 GB still to write" in msg and "\n" not in msg
        if mounted:
            assert f"mount {target} (tmpfs on tmpfs)" in msg


def test_torch_save_on_a_full_disk_counts_as_a_write_failure(tmp_path: Path) -> None:
    target = tmp_path / "small"
    with small_tmpfs(target, "64k") as mounted:
        if not mounted:
            pytest.skip("cannot mount a tmpfs here (needs root); the OSError path is tested")
        with pytest.raises(RuntimeError) as err:
            torch.save(torch.zeros(1 << 18), target / "x.pt")
        assert disk.is_write_failure(err.value)
        msg = str(disk.write_failure("train", err.value, target))
        assert "torch could not write" in msg and f"mount {target}" in msg


def test_other_errors_pass_through(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError), disk.guard("x", tmp_path):
        open(tmp_path / "missing")  # noqa: SIM115
    with pytest.raises(OSError) as err, disk.guard("x", tmp_path):
        raise OSError(errno.EACCES, "Permission denied")
    assert not isinstance(err.value, disk.DiskError)


def test_layout_says_one_or_two_filesystems(tmp_path: Path) -> None:
    assert "one filesystem: publish by hardlink" in disk.layout(tmp_path / "a", tmp_path / "b")
    other = tmp_path / "other"
    with small_tmpfs(other, "1m") as mounted:
        if not mounted:
            pytest.skip("cannot mount a tmpfs here (needs root); extract's EXDEV test injects it")
        line = disk.layout(other / "work", tmp_path / "out")
        assert "different filesystems: publish copies" in line and str(other) in line
