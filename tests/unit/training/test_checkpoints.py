"""Checkpoint lifecycle: complete epochs, discarding half-done ones, pruning, the resume rule."""

from __future__ import annotations

import json
from pathlib import Path

from eagle3_pipeline.training import checkpoints as ck


def _fake_epoch(save_dir: Path, epoch: int, *, complete: bool, val_loss: float | None) -> None:
    d = save_dir / str(epoch)
    d.mkdir(parents=True)
    (d / "model.safetensors").write_bytes(b"x")
    if val_loss is not None:
        (d / "val_metrics.json").write_text(json.dumps({"loss_epoch": val_loss}))
    (save_dir / f"epoch{epoch}_end").symlink_to(str(epoch))
    if complete:
        (d / ck.COMPLETE_MARKER).write_text(json.dumps({"epoch": epoch, "global_step": 10 * epoch}))


def test_discard_incomplete_keeps_only_marked_epochs(tmp_path: Path) -> None:
    save = tmp_path / "ckpt"
    _fake_epoch(save, 0, complete=True, val_loss=0.5)
    _fake_epoch(save, 1, complete=True, val_loss=0.4)
    _fake_epoch(save, 2, complete=False, val_loss=0.3)  # killed before its marker
    (save / "interrupted").mkdir()
    (save / "checkpoint_best").symlink_to("2")
    removed = ck.discard_incomplete(save)
    assert set(removed) == {"2", "interrupted", "epoch2_end", "checkpoint_best"}
    assert ck.complete_epochs(save) == [0, 1]
    assert sorted(p.name for p in save.iterdir()) == [
        "0",
        "1",
        "checkpoint_best",
        "epoch0_end",
        "epoch1_end",
    ]
    assert ck.best_checkpoint(save) == save / "1"  # re-pointed to the best complete epoch
    assert ck.discard_incomplete(save) == []


def test_prune_keeps_last_and_best(tmp_path: Path) -> None:
    save = tmp_path / "ckpt"
    for epoch, loss in enumerate([0.5, 0.2, 0.4, 0.3, 0.35]):
        _fake_epoch(save, epoch, complete=epoch < 4, val_loss=loss)
    (save / "checkpoint_best").symlink_to("1")
    ck.prune(save, keep_last=2)
    assert ck.complete_epochs(save) == [1, 2, 3]  # best (1) + the newest two complete
    assert (save / "4").is_dir()  # incomplete: not the pruner's business
    assert not (save / "epoch0_end").is_symlink()
    ck.prune(save, keep_last=1)
    assert ck.complete_epochs(save) == [1, 3]


def test_resume_rule_is_speculators_then_the_last_complete_epoch(tmp_path: Path) -> None:
    save = tmp_path / "ckpt"
    assert ck.resume_epoch(save) is None and ck.resume_step(save) is None
    _fake_epoch(save, 0, complete=True, val_loss=0.5)
    _fake_epoch(save, 1, complete=False, val_loss=0.4)
    assert ck.resume_epoch(save) == 1  # speculators' rule: the highest numbered directory
    ck.discard_incomplete(save)
    assert ck.resume_epoch(save) == 0 and ck.resume_step(save) == 0
    _fake_epoch(save, 1, complete=True, val_loss=0.4)
    assert ck.resume_epoch(save) == 1 and ck.resume_step(save) == 10
