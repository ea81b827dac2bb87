"""Epoch checkpoints in save_dir: complete or not, exact resume, pruning, the best one.

speculators 0.9.0 (`checkpoint_freq` 1) saves one directory per epoch (`0/`, `1/`, ...: config.json,
bf16 model.safetensors, optimizer/scheduler state, training_state.json), links `epoch<N>_end`,
`checkpoint_best` (lowest validation `loss_epoch`) and, after a signal, `interrupted/`. It resumes
from the highest numbered directory, `interrupted/` never.

What we add at the end of each epoch (after save, validation and `checkpoint_best`), as a scoped
patch of its Trainer: `exact_state.pt` (full-precision weights and optimizer states: resuming from
the bf16 files alone rounds them), `rng_state_rank<r>.pt` (taken after validation, whose DataLoader
draws from torch's RNG) and, last, the completion marker. A directory without the marker is
incomplete and `discard_incomplete` removes it before speculators looks. On resume the exact state
and RNG are restored after speculators loaded its own, so a resumed CPU run ends with the same
weights, bit for bit. A write that fails (disk full) is a disk.DiskError naming the mount and its
free space. Rank 0 writes exact state and markers; every rank its RNG. With FSDP (sharded
optimizer state) no exact state is written: resume is then close, not bitwise.
"""

from __future__ import annotations

import contextlib
import json
import random
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eagle3_pipeline.core import disk
from eagle3_pipeline.core.atomic import atomic_write
from eagle3_pipeline.training.speculators_patches import check_version

COMPLETE_MARKER = "checkpoint_complete.json"
EXACT_STATE = "exact_state.pt"


def complete_epochs(save_dir: Path) -> list[int]:
    """Epoch numbers whose directory carries the completion marker, ascending."""
    if not save_dir.is_dir():
        return []
    return sorted(
        int(d.name)
        for d in save_dir.iterdir()
        if d.name.isdigit() and not d.is_symlink() and (d / COMPLETE_MARKER).is_file()
    )


def resume_epoch(save_dir: str | Path) -> int | None:
    """The epoch a run in save_dir resumes from (speculators' own rule), or None.

    After `discard_incomplete` that is the last complete epoch.
    """
    check_version()  # the rule is 0.9.0's
    from speculators.train.checkpointer import SingleGPUCheckpointer

    epoch = SingleGPUCheckpointer(save_dir).previous_epoch
    return None if epoch == -1 else epoch


def resume_step(save_dir: Path) -> int | None:
    """The global step a resumed run continues at (its first step), or None: a fresh run."""
    epoch = resume_epoch(save_dir)
    if epoch is None:
        return None
    marker = json.loads((save_dir / str(epoch) / COMPLETE_MARKER).read_text())
    return int(marker["global_step"])


def discard_incomplete(save_dir: Path) -> list[str]:
    """Remove what a killed run left half-done, so speculators resumes from a complete epoch.

    Numbered directories without the marker, `interrupted/`, and links that pointed at them.
    `checkpoint_best` is re-pointed to the complete epoch with the lowest saved validation loss
    (or removed). Returns the names removed.
    """
    if not save_dir.is_dir():
        return []
    complete = set(complete_epochs(save_dir))
    removed: list[str] = []
    for d in sorted(save_dir.iterdir()):
        if d.is_symlink():
            continue
        if d.is_dir() and (
            d.name == "interrupted" or (d.name.isdigit() and int(d.name) not in complete)
        ):
            shutil.rmtree(d)
            removed.append(d.name)
    for link in save_dir.iterdir():
        if link.is_symlink() and not link.exists():
            link.unlink()
            removed.append(link.name)
    best = save_dir / "checkpoint_best"
    if not best.exists():
        losses = {}
        for epoch in complete:
            val = save_dir / str(epoch) / "val_metrics.json"
            if val.is_file():
                losses[epoch] = json.loads(val.read_text())["loss_epoch"]
        if losses:
            best.symlink_to(str(min(losses, key=lambda e: (losses[e], e))))
    return removed


def prune(save_dir: Path, keep_last: int) -> None:
    """Delete complete epochs older than the newest `keep_last`, except the best one.

    The marker goes first: a kill halfway through leaves an incomplete directory, which the
    next start discards, never a complete-looking one with files missing.
    """
    complete = complete_epochs(save_dir)
    best = save_dir / "checkpoint_best"
    best_epoch = int(best.readlink().name) if best.is_symlink() else None
    for epoch in complete[:-keep_last]:
        if epoch == best_epoch:
            continue
        d = save_dir / str(epoch)
        (d / COMPLETE_MARKER).unlink()
        for link in save_dir.glob(f"epoch{epoch}_*"):
            if link.is_symlink():
                link.unlink()
        shutil.rmtree(d)


def best_checkpoint(save_dir: Path) -> Path:
    """The epoch directory `checkpoint_best` points to (lowest validation loss)."""
    link = save_dir / "checkpoint_best"
    if not link.is_symlink():
        raise FileNotFoundError(f"{link} does not exist: no epoch has been validated yet")
    target = save_dir / link.readlink()
    if not (target / "model.safetensors").is_file():
        raise FileNotFoundError(f"{link} points to {target}, which holds no model.safetensors")
    return target


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),  # noqa: NPY002 (the global one speculators seeds)
        "python": random.getstate(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])  # noqa: NPY002
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


@contextlib.contextmanager
def exact_resume(keep_last: int | None, *, exact: bool = True) -> Iterator[None]:
    """Scoped patches of speculators' Trainer: exact state, RNG, completion marker, pruning.

    `exact` False (FSDP: the full optimizer state would have to be gathered): resume uses
    speculators' bf16 files plus the RNG state, close but not bitwise.
    """
    from speculators.train import trainer as trainer_mod

    trainer_cls = trainer_mod.Trainer
    best_original = trainer_cls.maybe_update_best
    run_original = trainer_cls.run_training

    def raw_model(self: Any) -> torch.nn.Module:
        return getattr(self.model, "module", self.model)

    def best_then_state(self: Any, epoch: int, val_metrics: dict | None) -> None:
        # A failed write (disk full) ends the run with the OS's reason and the mount's free
        # space; the epoch has no marker, so the rerun discards it and resumes before it.
        with disk.guard("train", self.checkpointer.path):
            _best_then_state(self, epoch, val_metrics)

    def _best_then_state(self: Any, epoch: int, val_metrics: dict | None) -> None:
        # The end of an epoch's iteration: after training, checkpoint and validation (which
        # draws from torch's RNG: each DataLoader iteration takes a base seed from it).
        best_original(self, epoch, val_metrics)
        d = self.checkpointer.path / str(epoch)
        torch.save(_rng_state(), d / f"rng_state_rank{_rank()}.pt")
        if exact and _rank() == 0:
            state = {
                "model": {k: v.detach().clone() for k, v in raw_model(self).state_dict().items()},
                "optimizers": [opt.state_dict() for opt in self.optimizers],
            }
            atomic_write(d / EXACT_STATE, lambda p: torch.save(state, p))
        if self.is_distributed:
            import torch.distributed as dist

            dist.barrier()  # every rank's RNG file exists before the marker says complete
        if _rank() != 0:
            return
        marker = {"epoch": epoch, "global_step": self.global_step}
        atomic_write(d / COMPLETE_MARKER, lambda p: p.write_text(json.dumps(marker)))
        if keep_last is not None:
            prune(self.checkpointer.path, keep_last)

    def restore_then_run(self: Any) -> Any:
        epoch = self.checkpointer.previous_epoch
        if self.resume_from_checkpoint and epoch != -1:
            d = self.checkpointer.path / str(epoch)
            if exact:
                state = torch.load(d / EXACT_STATE, map_location="cpu", weights_only=False)
                model = raw_model(self)
                model.load_state_dict(state["model"])
                for opt, opt_state in zip(self.optimizers, state["optimizers"], strict=True):
                    opt.load_state_dict(opt_state)
            rng = d / f"rng_state_rank{_rank()}.pt"
            _set_rng_state(torch.load(rng, weights_only=False))
        return run_original(self)

    trainer_cls.maybe_update_best = best_then_state
    trainer_cls.run_training = restore_then_run
    try:
        yield
    finally:
        trainer_cls.maybe_update_best = best_original
        trainer_cls.run_training = run_original
