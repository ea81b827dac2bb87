"""Run speculators' own EAGLE-3 trainer in-process, on CPU as on GPU.

We depend on speculators' trainer rather than rewrite it, so its checkpoints are exactly what
vLLM loads. speculators 0.9.0 assumes CUDA; `apply_cpu_shims` patches the four places that break
on a CPU-only machine, and `run_training` picks `sdpa` attention and the eager loss there (flex
attention and the fused loss need a GPU). On a CUDA machine nothing is patched.

What speculators 0.9.0 does, as observed (the contract the callers rely on):

save_dir after training (`checkpoint_freq` 1, `save_best` off)::

    run.yaml, train_command.txt      resolved config; argv + versions + timestamp
    speculators.patch                only when the venv sits inside a git work tree:
                                     `git diff HEAD` of THAT tree (speculators looks for .git
                                     upwards from its own install path)
    0/ 1/ ...                        one directory per epoch, each: config.json,
                                     model.safetensors (bf16 draft weights incl. d2t/t2d,
                                     embed_tokens and lm_head; not verifier_lm_head /
                                     verifier_norm), optimizer_state_dict.pt,
                                     scheduler_state_dict.pt (unless scheduler "none"),
                                     training_state.json, train_command.txt, and
                                     val_metrics.json when that epoch became the best
    epoch<N>_end -> N                one readable symlink per epoch
    checkpoint_best -> N             epoch with the lowest validation `loss_epoch`
    interrupted/                     only after SIGINT/SIGTERM; never resumed from

Resume: the highest numbered directory is loaded (weights, optimizer, scheduler, global step)
and training continues with the next epoch. `interrupted/` is ignored (speculators only warns).

Metric dicts on the `speculators.metrics` logger (passed to `on_metrics` with their step):
train, every `log_every_steps` optimizer steps, step = global step (0-based)::

    {"train": {"loss", "loss_<k>", "full_acc_<k>", "cond_acc_<k>", "error_records"},
     "profile": {"step_ms", "fwd_ms", "bwd_ms", "tokens_per_s", ...}, "epoch": e,
     "lr": float, "global_step": s}

with k = 0..ttt_steps-1 the draft position: `loss_k` its KL loss (times the TTT decay),
`loss` their sum, `full_acc_k` the share of supervised tokens drafted right at k,
`cond_acc_k` the same given positions < k right; `error_records` counts dropped rows.
Validation, once per epoch, step = optimizer steps done so far (equal to the next train step)::

    {"val": {the same keys with an "_epoch" suffix: "loss_epoch", "full_acc_0_epoch", ...},
     "epoch": e}

`checkpoint_best` follows the lowest `val.loss_epoch`. The run-config record speculators logs
first (no step) is not passed on.

Hidden-state files: `hidden_states [seq, n, hidden]` holds the aux layers in the order of
`target_layer_ids`, then the final layer LAST (n = len(target_layer_ids) + 1): speculators
takes `[:, :-1]` as the aux input and `[:, -1]` as the verifier's last hidden state (fed through
the verifier's final norm and lm_head to make the targets). `target_layer_ids` are the aux ids
only; they are written to config.json as `eagle_aux_hidden_state_layer_ids`.

Train/val split: ordered, not shuffled: rows [0, int(n * train_data_ratio)) train, the rest
validate; put validation rows last and use `train_data_ratio_for`. The seed orders the packed
training batches only (a numpy Generator seeded with seed + epoch: no state to save).

What we add (scoped patches of the Trainer for one `main()` call, `_exact_resume`):

* at the end of each epoch (after training, speculators' save, validation and
  `checkpoint_best`) its directory also gets `exact_state.pt` (the model's full state dict and
  the optimizer states in their training dtype: speculators' own files are bf16, so resuming
  from them alone rounds the weights and Adam moments), `rng_state_rank<r>.pt` (torch CPU and
  CUDA, numpy, python `random`; taken after validation because every DataLoader iteration draws
  its base seed from torch's RNG), and, last, `checkpoint_complete.json`. A directory without
  it is incomplete: `discard_incomplete` removes it (and links to it) before speculators picks
  the highest numbered directory;
* on resume the exact state and RNG are restored after speculators loaded its own, so on CPU a
  resumed run ends with the same weights, bit for bit, as an uninterrupted one;
* `keep_last`: older complete epochs are deleted; the best one and the newest are never;
* `grad_accumulation`: optimizer, scheduler, zero_grad and clipping act on every N-th
  micro-batch (and the last of an epoch); gradients are averaged over the group first;
* the clipped gradient norm joins each train record as `grad_norm`;
* speculators' rich progress bars go when TQDM_DISABLE is set (they ignore it).

Distributed (torchrun sets LOCAL_RANK): speculators initialises torch.distributed itself with
the accelerator's backend (nccl), wraps the drafter in DDP, or FSDP2 `fully_shard` with
`fsdp_shard`, and its packing sampler gives each rank its own bins of `total_seq_len` tokens
(the global batch is nproc x that). On CPU `apply_cpu_shims` swaps in gloo. Rank 0 alone saves
checkpoints (speculators) and, here, exact state and markers; every rank saves its RNG.
With FSDP the exact state is not written (the optimizer state is sharded): resume then uses
speculators' bf16 files plus the RNG state.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import logging
import math
import os
import random
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal, TypedDict

import numpy as np
import torch

from eagle3_pipeline.atomic import atomic_write, replace_dir
from eagle3_pipeline.training.init_from import init_from_checkpoint

PINNED_SPECULATORS = "0.9.0"
METRICS_LOGGER = "speculators.metrics"

MetricsCallback = Callable[[dict[str, Any], int], None]

_shims_applied = False


class TrainingSample(TypedDict):
    """One training row; `hidden_states_file` already exists (we link it, never copy it)."""

    input_ids: list[int]
    loss_mask: list[int]
    hidden_states_file: Path


class TrainingInterrupted(KeyboardInterrupt):
    """speculators caught SIGINT/SIGTERM, saved `interrupted/` and returned as if done.

    A KeyboardInterrupt so that `except Exception` cleanup in callers does not swallow it and
    the process exits non-zero.
    """


def check_version() -> None:
    """Refuse any speculators but the pinned one: the shims patch 0.9.0's internals by name."""
    installed = importlib.metadata.version("speculators")
    if installed != PINNED_SPECULATORS:
        raise RuntimeError(
            f"speculators {installed} is installed but eagle3_pipeline.training is written "
            f" against {PINNED_SPECULATORS}: install speculators=={PINNED_SPECULATORS} "
            "(constraints/) or re-check the shims and saved layout against the new version"
        )


def apply_cpu_shims() -> None:
    """Make speculators' single-process trainer run on CPU; a no-op where CUDA is available."""
    global _shims_applied
    check_version()
    if _shims_applied or torch.cuda.is_available():
        return
    from speculators.train import checkpointer, cli, trainer

    # The trainer moves model and batches to get_local_rank(), the int 0, which means cuda:0.
    trainer.get_local_rank = lambda: "cpu"
    # Step timing calls torch.accelerator.synchronize(), which raises without an accelerator.
    torch.accelerator.synchronize = lambda device=None: None
    # Without an accelerator the trainer asks for a "cuda" autocast, which torch rejects on CPU.
    # We ask for a CPU autocast in float32 (run_training sets hidden_states_dtype), which torch
    # turns into plain fp32: bf16 autocast on this CPU made each step ~6x slower (backward 10x).
    original_init = trainer.Trainer.__init__

    def init_with_cpu_autocast(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        self.device_type = "cpu"

    trainer.Trainer.__init__ = init_with_cpu_autocast
    # Resuming loads weights and optimizer state onto get_current_device(), which says cuda:0.
    checkpointer.get_current_device = lambda: "cpu"
    # Under torchrun, speculators picks the accelerator's backend and raises without one.
    cli.maybe_setup_distributed = _setup_distributed_gloo
    _shims_applied = True


def _setup_distributed_gloo(sp_size: int = 1) -> None:
    """speculators' `maybe_setup_distributed` for CPU processes: gloo, no device binding.

    Fills the same module state (ranks, DP/SP groups) that its samplers and checkpointer read.
    """
    import torch.distributed as dist
    from speculators.train import distributed as sd

    if "LOCAL_RANK" not in os.environ:
        return
    dist.init_process_group("gloo")
    sd._local_rank = int(os.environ["LOCAL_RANK"])
    sd._is_distributed = True
    sd._rank = dist.get_rank()
    sd._world_size = dist.get_world_size()
    sd._init_sp_process_groups(sd._rank, sd._world_size, sp_size)


def write_training_data(
    data_dir: Path,
    samples: list[TrainingSample],
    *,
    link: Literal["symlink", "hardlink"] = "symlink",
) -> None:
    """Lay out the directory speculators' `--data-path` reads, replacing `data_dir` whole.

    Row i of the arrow dataset (input_ids, loss_mask, seq_len; torch format) pairs with
    `hidden_states/hs_<i>.safetensors`, a relative symlink (or hardlink) to the sample's file.
    Each file is checked here because speculators silently drops a row whose `token_ids`
    differ from its `input_ids`, and fails with a shape error deep in the model otherwise.
    """
    from datasets import Dataset

    if not samples:
        raise ValueError("write_training_data: no samples")
    layer_shape: tuple[int, ...] | None = None
    for i, sample in enumerate(samples):
        shape = _check_hidden_states_file(i, sample)
        if layer_shape is None:
            layer_shape = shape
        elif shape != layer_shape:
            raise ValueError(
                f"sample {i}: {sample['hidden_states_file']} has [n_layers, hidden] = "
                f"{list(shape)}, sample 0 has {list(layer_shape)}: all files must come from "
                "one extraction"
            )

    with replace_dir(data_dir) as tmp:
        dataset = Dataset.from_dict(
            {
                "input_ids": [s["input_ids"] for s in samples],
                "loss_mask": [s["loss_mask"] for s in samples],
                "seq_len": [len(s["input_ids"]) for s in samples],
            }
        )
        # speculators compares stored token_ids with these rows as torch tensors.
        dataset.set_format(type="torch")
        dataset.save_to_disk(str(tmp))
        hs_dir = tmp / "hidden_states"
        hs_dir.mkdir()
        for i, sample in enumerate(samples):
            source = Path(sample["hidden_states_file"]).absolute()
            target = hs_dir / f"hs_{i}.safetensors"
            if link == "symlink":
                # tmp is a sibling of data_dir, so the relative path survives the rename.
                target.symlink_to(os.path.relpath(source, hs_dir))
            else:
                os.link(source, target)


def train_data_ratio_for(n_train: int, n_rows: int) -> float:
    """The `train_data_ratio` that makes speculators train on exactly the first n_train rows.

    speculators truncates int(n_rows * ratio); n_train / n_rows can land just below n_train.
    """
    if not 0 < n_train < n_rows:
        raise ValueError(f"need 0 < n_train < n_rows, got {n_train} of {n_rows}")
    return (n_train + 0.5) / n_rows


def _check_hidden_states_file(index: int, sample: TrainingSample) -> tuple[int, ...]:
    """Return the file's [n_layers, hidden]; raise ValueError naming what does not match."""
    from safetensors import safe_open

    path = Path(sample["hidden_states_file"])
    seq = len(sample["input_ids"])
    if len(sample["loss_mask"]) != seq:
        raise ValueError(
            f"sample {index}: {len(sample['loss_mask'])} loss_mask values for {seq} input_ids"
        )
    if not path.is_file():
        raise ValueError(f"sample {index}: hidden-state file {path} does not exist")
    with safe_open(str(path), framework="pt") as f:
        keys = set(f.keys())
        if not {"hidden_states", "token_ids"} <= keys:
            raise ValueError(
                f"sample {index}: {path} holds {sorted(keys)}; speculators needs "
                "'hidden_states' and 'token_ids'"
            )
        shape = tuple(f.get_slice("hidden_states").get_shape())
        token_ids = f.get_tensor("token_ids").tolist()
    if len(shape) != 3 or shape[0] != seq:
        raise ValueError(
            f"sample {index}: {path} hidden_states has shape {list(shape)}, expected "
            f"[{seq}, n_layers, hidden]"
        )
    if token_ids != list(sample["input_ids"]):
        raise ValueError(f"sample {index}: token_ids in {path} differ from the row's input_ids")
    return shape[1:]


def run_training(
    *,
    data_dir: Path,
    verifier_dir: Path,
    save_dir: Path,
    d2t_path: Path,
    t2d_path: Path,
    draft_vocab_size: int,
    target_layer_ids: list[int],
    epochs: int,
    lr: float,
    scheduler: Literal["cosine", "linear", "none"],
    warmup_ratio: float,
    noise_std: float,
    ttt_steps: int,
    ttt_step_loss_decay: float,
    total_seq_len: int,
    seed: int,
    num_workers: int,
    train_data_ratio: float,
    on_metrics: MetricsCallback | None,
    log_every_steps: int = 1,
    train_lm_head: bool = False,
    keep_last: int | None = None,
    grad_accumulation: int = 1,
    fsdp: bool = False,
    init_from: Path | None = None,
    init_vocab_mismatch: Literal["remap", "refuse"] = "remap",
    on_init_line: Callable[[str], None] = print,
) -> None:
    """Train (or resume) a 1-layer Llama EAGLE-3 drafter with speculators' trainer, AdamW.

    `target_layer_ids` are the aux layer ids only (the data's final layer is implied).
    `total_seq_len` is the token budget of one packed batch (per process). `on_metrics` gets
    every metric dict speculators logs (see the module docstring); an exception in it aborts
    training. `train_lm_head` un-freezes the draft lm_head, which speculators always freezes.
    Under torchrun (LOCAL_RANK set) each process calls this; the launcher must have called
    `discard_incomplete` first (a rank deleting directories while another lists them races).
    `fsdp` shards the drafter (speculators' `--fsdp-shard`; torchrun only).
    `init_from` (a drafter directory, flat or speculators format) initialises a fresh run;
    `on_init_line` receives its report (loaded/skipped/new tensors, parameter counts).
    Raises TrainingInterrupted when a signal stopped the run (rerunning resumes).
    """
    if noise_std < 0:
        raise ValueError(f"noise_std={noise_std} must be >= 0")
    if grad_accumulation < 1:
        raise ValueError(f"grad_accumulation={grad_accumulation} must be >= 1")
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last={keep_last} must be >= 1 (or None: keep every epoch)")
    if fsdp and "LOCAL_RANK" not in os.environ:
        raise ValueError("fsdp shards the drafter across processes: launch with torchrun")
    _check_layer_count(data_dir, target_layer_ids)
    apply_cpu_shims()
    if "LOCAL_RANK" not in os.environ:
        discard_incomplete(save_dir)
    from speculators.train.cli import main

    cfg = build_train_config(
        data_dir=data_dir,
        verifier_dir=verifier_dir,
        save_dir=save_dir,
        d2t_path=d2t_path,
        t2d_path=t2d_path,
        draft_vocab_size=draft_vocab_size,
        target_layer_ids=target_layer_ids,
        epochs=epochs,
        lr=lr,
        scheduler=scheduler,
        warmup_ratio=warmup_ratio,
        ttt_steps=ttt_steps,
        ttt_step_loss_decay=ttt_step_loss_decay,
        total_seq_len=total_seq_len,
        seed=seed,
        num_workers=num_workers,
        train_data_ratio=train_data_ratio,
        log_every_steps=log_every_steps,
        fsdp=fsdp,
    )

    interrupted_model = save_dir / "interrupted" / "model.safetensors"
    stamp_before = _mtime_ns(interrupted_model)
    metrics_logger = logging.getLogger(METRICS_LOGGER)
    steps = _StepControl(grad_accumulation)
    tap = _MetricsTap(on_metrics, steps) if on_metrics is not None else None
    if tap is not None:
        # A filter, not a handler: main() reconfigures this logger and drops its handlers,
        # and on the root logger speculators' console handler turns the dict into a string
        # before a later handler sees it. Logger filters survive and run first.
        metrics_logger.addFilter(tap)
    try:
        with (
            _lm_head_trainable() if train_lm_head else contextlib.nullcontext(),
            _hidden_state_noise(noise_std) if noise_std > 0 else contextlib.nullcontext(),
            _exact_resume(keep_last, exact=not fsdp),
            steps.patched(),
            _no_progress_bars() if os.environ.get("TQDM_DISABLE") else contextlib.nullcontext(),
            # Last: inside the lm_head un-freezing, after _exact_resume tidied the scratch dir.
            init_from_checkpoint(
                init_from,
                init_vocab_mismatch,
                save_dir,
                on_init_line,
                run_mapping=str(d2t_path.parent),
            ),
        ):
            main(cfg)
    finally:
        if tap is not None:
            metrics_logger.removeFilter(tap)

    last_epoch_model = save_dir / str(epochs - 1) / "model.safetensors"
    if _mtime_ns(interrupted_model) != stamp_before or not last_epoch_model.is_file():
        raise TrainingInterrupted(
            f"training stopped by a signal before epoch {epochs} finished (speculators saves "
            f"to {save_dir / 'interrupted'}); rerun to resume from the last complete epoch"
        )


def build_train_config(
    *,
    data_dir: Path,
    verifier_dir: Path,
    save_dir: Path,
    d2t_path: Path,
    t2d_path: Path,
    draft_vocab_size: int,
    target_layer_ids: list[int],
    epochs: int,
    lr: float,
    scheduler: Literal["cosine", "linear", "none"],
    warmup_ratio: float,
    ttt_steps: int,
    ttt_step_loss_decay: float,
    total_seq_len: int,
    seed: int,
    num_workers: int,
    train_data_ratio: float,
    log_every_steps: int = 1,
    fsdp: bool = False,
) -> Any:
    """speculators' TrainConfig for our settings (also what `speculators train` would get)."""
    from speculators.train.config import TrainConfig

    flags: dict[str, Any] = {
        "speculator_type": "eagle3",
        "seed": seed,
        "verifier_name_or_path": str(verifier_dir),
        "draft_arch": "llama",
        "num_layers": 1,
        "target_layer_ids": list(target_layer_ids),
        "draft_vocab_size": draft_vocab_size,
        "d2t_path": str(d2t_path),
        "t2d_path": str(t2d_path),
        # Only DFlash-family drafters use it; explicit so speculators loads no tokenizer.
        "mask_token_id": 0,
        "data_path": str(data_dir),
        # Reads bf16 files as they are and dequantizes fp8 files that carry scales.
        "hidden_states_backend": "fp8",
        # The default, "generate", would ask a vLLM server for a missing file.
        "on_missing": "raise",
        "total_seq_len": total_seq_len,
        "train_data_ratio": train_data_ratio,
        "num_workers": num_workers,
        "ttt_steps": ttt_steps,
        "ttt_step_loss_decay": ttt_step_loss_decay,
        "optimizer": "adamw",
        "lr": lr,
        "scheduler_type": scheduler,
        "scheduler_warmup_ratio": warmup_ratio,
        "epochs": epochs,
        "save_path": str(save_dir),
        "log_freq": log_every_steps,
    }
    if fsdp:
        flags["fsdp_shard"] = True
    if not torch.cuda.is_available():
        # Flex attention and the fused loss need a GPU.
        # fp32 on CPU: bf16 matmuls are emulated here (measured 6x slower per step).
        flags |= {
            "draft_attn_impl": "sdpa",
            "loss_implementation": "eager",
            "hidden_states_dtype": "float32",
        }
    return TrainConfig.from_sources(cli=flags, argv=_as_argv(flags))


def torchrun_command(nproc: int, module: str, args: list[str]) -> list[str]:
    """`python -m torch.distributed.run` (= torchrun) on one node, rendezvous on localhost."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        module,
        *args,
    ]


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


def discard_incomplete(save_dir: Path) -> list[str]:
    """Remove what a killed run left half-done, so speculators resumes from a complete epoch.

    Numbered directories without the marker, `interrupted/` (speculators never resumes from
    it), and links that pointed at them. `checkpoint_best` is re-pointed to the complete epoch
    with the lowest saved validation loss (or removed). Returns the names removed.
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


def _prune(save_dir: Path, keep_last: int) -> None:
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
def _exact_resume(keep_last: int | None, *, exact: bool = True) -> Iterator[None]:
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
            _prune(self.checkpointer.path, keep_last)

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


class _StepControl:
    """Gradient accumulation and the grad-norm record, as scoped patches of speculators' step.

    speculators 0.9.0 runs zero_grad, backward, clip, optimizer step and scheduler step on every
    batch. With N > 1, zero_grad acts on the first micro-batch of a group and clip, optimizer
    and scheduler on its last (the N-th, or the epoch's last): gradients then hold the sum over
    the group and are divided by its size first, so a step sees the mean gradient, as with one
    N times larger batch. The scheduler's horizon is counted in optimizer steps. Metrics and
    `global_step` stay per micro-batch; `grad_norm` is set only on micro-batches that stepped.
    """

    def __init__(self, accumulation: int) -> None:
        self.accumulation = accumulation
        self.grad_norm: float | None = None
        self._micro = 0  # index of the current micro-batch in the epoch
        self._epoch_batches = 0

    def _group_end(self) -> bool:
        i = self._micro
        return (i + 1) % self.accumulation == 0 or i + 1 == self._epoch_batches

    def _group_size(self) -> int:
        i = self._micro
        return i % self.accumulation + 1

    @contextlib.contextmanager
    def patched(self) -> Iterator[None]:
        from speculators.train import trainer as trainer_mod

        cls = trainer_mod.Trainer
        n = self.accumulation
        originals = {
            "train_epoch": cls.train_epoch,
            "_optimizers_zero_grad": cls._optimizers_zero_grad,
            "_optimizers_step": cls._optimizers_step,
            "_schedulers_step": cls._schedulers_step,
        }
        resolve_original = trainer_mod._resolve_scheduler_steps
        clip_original = torch.nn.utils.clip_grad_norm_
        ctl = self

        def train_epoch(trainer: Any, epoch: int, **kwargs: Any) -> Any:
            sampler = trainer.train_loader.batch_sampler
            if hasattr(sampler, "set_epoch"):
                sampler.set_epoch(epoch)
            ctl._epoch_batches = len(trainer.train_loader)
            ctl._micro = 0
            return originals["train_epoch"](trainer, epoch, **kwargs)

        def zero_grad(trainer: Any) -> None:
            ctl.grad_norm = None  # set again by clip when this micro-batch ends a group
            if ctl._micro % n == 0:
                originals["_optimizers_zero_grad"](trainer)

        def clip(parameters: Any, max_norm: float, *args: Any, **kwargs: Any) -> Any:
            if not ctl._group_end():
                return None
            parameters = list(parameters)
            size = ctl._group_size()
            if size > 1:
                for p in parameters:
                    if p.grad is not None:
                        p.grad.div_(size)
            norm = clip_original(parameters, max_norm, *args, **kwargs)
            ctl.grad_norm = float(norm)
            return norm

        def opt_step(trainer: Any) -> None:
            if ctl._group_end():
                originals["_optimizers_step"](trainer)

        def sched_step(trainer: Any) -> None:
            if ctl._group_end():
                originals["_schedulers_step"](trainer)
            ctl._micro += 1

        def resolve(config: Any, train_loader_len: int) -> tuple[int, int]:
            return resolve_original(config, math.ceil(train_loader_len / n))

        cls.train_epoch = train_epoch
        cls._optimizers_zero_grad = zero_grad
        cls._optimizers_step = opt_step
        cls._schedulers_step = sched_step
        trainer_mod._resolve_scheduler_steps = resolve
        torch.nn.utils.clip_grad_norm_ = clip
        try:
            yield
        finally:
            for name, fn in originals.items():
                setattr(cls, name, fn)
            trainer_mod._resolve_scheduler_steps = resolve_original
            torch.nn.utils.clip_grad_norm_ = clip_original


def best_checkpoint(save_dir: Path) -> Path:
    """The epoch directory `checkpoint_best` points to (lowest validation loss)."""
    link = save_dir / "checkpoint_best"
    if not link.is_symlink():
        raise FileNotFoundError(f"{link} does not exist: no epoch has been validated yet")
    target = save_dir / link.readlink()
    if not (target / "model.safetensors").is_file():
        raise FileNotFoundError(f"{link} points to {target}, which holds no model.safetensors")
    return target


def _check_layer_count(data_dir: Path, target_layer_ids: list[int]) -> None:
    """Fail early when files and ids disagree (speculators fails later with a matmul error)."""
    from safetensors import safe_open

    path = data_dir / "hidden_states" / "hs_0.safetensors"
    with safe_open(str(path), framework="pt") as f:
        n_layers = f.get_slice("hidden_states").get_shape()[1]
    if n_layers != len(target_layer_ids) + 1:
        raise ValueError(
            f"{path} holds {n_layers} layers but target_layer_ids {target_layer_ids} name "
            f"{len(target_layer_ids)} aux layers: pass the aux ids only (the files hold them "
            "plus the final layer, last)"
        )


def _as_argv(flags: dict[str, Any]) -> list[str]:
    """The equivalent `speculators train` command, recorded in train_command.txt."""
    argv = ["speculators", "train"]
    for key, value in flags.items():
        values = value if isinstance(value, list) else [value]
        argv += [f"--{key.replace('_', '-')}", *map(str, values)]
    return argv


def _mtime_ns(path: Path) -> int | None:
    return path.stat().st_mtime_ns if path.exists() else None


class _MetricsTap(logging.Filter):
    """Passes speculators' metric dicts (those logged with a step) to a callback, and only there."""

    def __init__(self, callback: MetricsCallback, steps: _StepControl | None = None) -> None:
        super().__init__()
        self._callback = callback
        self._steps = steps

    def filter(self, record: logging.LogRecord) -> bool:
        step = getattr(record, "step", None)
        if isinstance(record.msg, dict) and step is not None:
            steps = self._steps
            if "train" in record.msg and steps is not None and steps.grad_norm is not None:
                record.msg["grad_norm"] = steps.grad_norm
            # Not caught here: an exception in the callback stops training.
            self._callback(record.msg, step)
            # Consumed: the callback prints its own plain lines; propagated, the dict would be
            # dumped whole by speculators' console handler at every step.
            return False
        return True


@contextlib.contextmanager
def _no_progress_bars() -> Iterator[None]:
    """speculators' rich progress bars off (they ignore TQDM_DISABLE): noise in a log file."""
    from speculators.train import trainer as trainer_mod

    original = trainer_mod.tqdm
    trainer_mod.tqdm = lambda iterable, **_: iterable
    try:
        yield
    finally:
        trainer_mod.tqdm = original


@contextlib.contextmanager
def _lm_head_trainable() -> Iterator[None]:
    """Un-freeze the draft lm_head for one run.

    speculators 0.9.0 has no switch for it: `load_verifier_weights` freezes lm_head every time
    the model is built. This is the one patch outside `apply_cpu_shims`, because it is a
    training option, not a CPU fix; it is scoped to the `main()` call and applies on GPU too.
    AdamW receives every parameter, so the head is optimized once it requires grad; its
    weights are saved in model.safetensors and restored on resume.
    """
    from speculators.models.eagle3.core import Eagle3DraftModel

    original = Eagle3DraftModel.load_verifier_weights

    def load_then_unfreeze(self: Any) -> None:
        original(self)
        self.lm_head.weight.requires_grad_(True)

    Eagle3DraftModel.load_verifier_weights = load_then_unfreeze
    try:
        yield
    finally:
        Eagle3DraftModel.load_verifier_weights = original


@contextlib.contextmanager
def _hidden_state_noise(std: float) -> Iterator[None]:
    """Gaussian noise on the verifier features fed to the drafter, in training steps only.

    speculators 0.9.0 has no such option. Noise makes the drafter robust to the small
    differences between the stored features and the server's (bf16, other kernels, fp8 store).
    Scoped to one `main()` call; validation (model.eval()) sees clean features. The noise comes
    from torch's global RNG, which speculators seeds, so runs stay reproducible.
    """
    from speculators.models.eagle3.core import Eagle3DraftModel

    original = Eagle3DraftModel.forward

    def noisy_forward(self: Any, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if self.training:
            hidden_states = hidden_states + torch.randn_like(hidden_states) * std
        return original(self, hidden_states, *args, **kwargs)

    Eagle3DraftModel.forward = noisy_forward
    try:
        yield
    finally:
        Eagle3DraftModel.forward = original
