"""Writes that fail outside extract: generate's journal, train's checkpoints, any stage's write.

Each ends at once with the OS's reason, the mount and its free space, and leaves what a rerun
resumes from: journaled rows, complete epochs.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from small_fs import enospc, small_tmpfs

from eagle3_pipeline import cli
from eagle3_pipeline.core import disk, resume


@pytest.mark.parametrize("how", ["tmpfs", "injected"])
def test_journal_append_on_a_full_disk(
    how: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    work = tmp_path / "generate"
    with small_tmpfs(work, "64k") if how == "tmpfs" else contextlib.nullcontext(False) as mounted:
        if how == "tmpfs" and not mounted:
            pytest.skip("cannot mount a tmpfs here (needs root); the injected case runs instead")
        journal = resume.Journal(work / "done.jsonl")
        journal.append([{"id": "a", "content": "x"}])
        if mounted:
            with contextlib.suppress(OSError), open(work / "ballast", "wb") as fh:
                fh.write(b"\0" * (1 << 20))  # fills the disk to the last block
        else:
            monkeypatch.setattr(resume.os, "fsync", lambda _fd: (_ for _ in ()).throw(enospc()))
        with pytest.raises(disk.DiskError) as err:
            journal.append([{"id": "b", "content": "y" * 8192}])
        msg = str(err.value)
        assert msg.startswith(f"generate: writing {work / 'done.jsonl'} failed: [Errno 28]")
        assert "free of" in msg and "\n" not in msg
        if mounted:
            assert f"mount {work} (tmpfs on tmpfs)" in msg
            (work / "ballast").unlink()
        assert [r["id"] for r in journal.read()][:1] == ["a"]  # what was journaled stays


class _FakeTrainer:
    """The attributes of speculators' Trainer that our end-of-epoch patch uses."""

    def __init__(self, save_dir: Path) -> None:
        self.checkpointer = SimpleNamespace(path=save_dir)
        self.model = torch.nn.Linear(256, 256)
        self.optimizers = [torch.optim.AdamW(self.model.parameters())]
        self.global_step = 7
        self.is_distributed = False


@pytest.mark.parametrize("how", ["tmpfs", "injected"])
def test_checkpoint_write_on_a_full_disk_leaves_no_complete_epoch(
    how: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from speculators.train import trainer as trainer_mod

    from eagle3_pipeline.training import checkpoints

    save_dir = tmp_path / "checkpoints"
    monkeypatch.setattr(trainer_mod.Trainer, "maybe_update_best", lambda *_a: None)
    with small_tmpfs(save_dir, "128k") if how == "tmpfs" else contextlib.nullcontext(False) as m:
        if how == "tmpfs" and not m:
            pytest.skip("cannot mount a tmpfs here (needs root); the injected case runs instead")
        (save_dir / "0").mkdir(parents=True)
        if not m:
            monkeypatch.setattr(
                checkpoints.torch,
                "save",
                lambda *_a: (_ for _ in ()).throw(
                    RuntimeError(
                        "[enforce fail at inline_container.cc:672] . unexpected pos 1 vs 0"
                    )
                ),
            )
        with checkpoints.exact_resume(keep_last=None), pytest.raises(disk.DiskError) as err:
            trainer_mod.Trainer.maybe_update_best(_FakeTrainer(save_dir), 0, None)
        msg = str(err.value)
        assert msg.startswith("train: writing ") and "free of" in msg
        if m:
            assert f"mount {save_dir} (tmpfs on tmpfs)" in msg
        assert checkpoints.complete_epochs(save_dir) == []  # the rerun resumes before it
        assert checkpoints.discard_incomplete(save_dir) == ["0"]


def test_any_stage_write_the_stage_did_not_guard_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    from eagle3_pipeline.stages import vocab

    monkeypatch.chdir(tmp_path)
    (tmp_path / "params.yaml").write_text("{}\n")

    def full(_params) -> None:
        raise enospc(tmp_path / "data/vocab/d2t.npy")

    monkeypatch.setattr(vocab, "run", full)
    assert cli.main(["vocab"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: vocab: writing {tmp_path}/data/vocab/d2t.npy failed: [Errno 28]")
    assert "free of" in err and len(err.strip().splitlines()) == 1
