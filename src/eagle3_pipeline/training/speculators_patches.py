"""Patches of speculators 0.9.0's trainer: CPU shims, and scoped training options it lacks.

`apply_shims` fixes, once per process, the places that assume CUDA on a CPU machine, and on a
CUDA machine the two places that fail under torch.compile. The context managers patch one
`main()` call and undo it after: no progress bars, a trainable lm_head, noise on the hidden
states, gradient accumulation with the grad-norm record, a record of the rows trained on. All
patch internals by name, hence `check_version`.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from eagle3_pipeline.core import atomic, environment
from eagle3_pipeline.drafter.flex_kernel import flex_attention_main_kernel
from eagle3_pipeline.training.data import TRAINED_ROWS, loaded_rows

PINNED_SPECULATORS = "0.9.0"

_shims_applied = False


def check_version() -> None:
    """Refuse any speculators but the pinned one, the only version known to work: the patches
    (docs/training.md, "The speculators patch set") reach 0.9.0's internals by name. Another
    version is tried by pinning it in constraints/shared.txt, re-locking, re-checking each patch
    and setting PINNED_SPECULATORS; nothing overrides this check at run time."""
    installed = importlib.metadata.version("speculators")
    if installed != PINNED_SPECULATORS:
        raise RuntimeError(
            f"speculators {installed} is installed, but eagle3_pipeline.training is known to work "
            f"with speculators {PINNED_SPECULATORS} only: its patches reach speculators' internals "
            "by name (listed in docs/training.md, 'The speculators patch set'); install the "
            f"locked {PINNED_SPECULATORS} (locks/), or, to try {installed}, pin it in "
            "constraints/shared.txt, run `make lock` and `make venv`, re-check each listed patch "
            "against it and set PINNED_SPECULATORS in training/speculators_patches.py"
        )


def apply_shims() -> None:
    """The CPU shims on a CPU machine; on a CUDA machine, the two compile fixes."""
    check_version()
    if torch.cuda.is_available():
        separate_fused_loss_configs()
        flex_attention_main_kernel()
    else:
        apply_cpu_shims()


def separate_fused_loss_configs() -> None:
    """Give each of speculators' fused-loss Triton kernels its own autotune config list.

    Both kernels are decorated by one `triton.autotune`, so their Autotuners share one `configs`
    list. Dynamo refuses a list reached from two globals when it traces the loss's forward and
    backward inside the compiled `compute_metrics` (`ListVariable ... is already tracked for
    mutation`), which failed the first training step on an H200 (torch 2.11, `make gpu-check`).
    The kernels, configs and autotuning are unchanged; only the list objects differ.
    """
    try:
        from speculators.losses import fused
    except ImportError:  # no Triton: speculators itself refuses the fused loss
        return
    kernels = (fused.loss_forward_kernel, fused.loss_backward_kernel)
    if kernels[0].configs is kernels[1].configs:
        kernels[1].configs = list(kernels[1].configs)


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
    # We ask for a CPU autocast in float32 (build_train_config sets hidden_states_dtype), which
    # torch turns into plain fp32: bf16 autocast on this CPU made each step ~6x slower.
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


@contextlib.contextmanager
def no_progress_bars() -> Iterator[None]:
    """speculators' rich progress bars off (they ignore TQDM_DISABLE): noise in a log file."""
    from speculators.train import trainer as trainer_mod

    original = trainer_mod.tqdm
    trainer_mod.tqdm = lambda iterable, **_: iterable
    try:
        yield
    finally:
        trainer_mod.tqdm = original


# speculators' loader builder sets these in the calling process (for its dataloader workers).
THREAD_VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


@contextlib.contextmanager
def own_thread_env() -> Iterator[None]:
    """Keep speculators' thread limits inside the run: `create_train_val_loaders` sets
    OMP/MKL/OPENBLAS_NUM_THREADS=1 in the process that calls it, which an in-process caller
    would pass on to every process it starts after (one thread: other float sums)."""
    with environment.restored(THREAD_VARS):
        yield


@contextlib.contextmanager
def loaded_rows_record(save_dir: Path) -> Iterator[None]:
    """Record what the run's training loader was given: `cli.create_train_val_loaders` returns
    as before, and each rank's count and hash of the sample ids its training dataset holds
    (data.loaded_rows) are gathered to rank 0, which writes them to save_dir/TRAINED_ROWS. Data
    without a `sample_id` column: nothing is recorded."""
    from speculators.train import cli

    original = cli.create_train_val_loaders

    def create_and_record(*args: Any, **kwargs: Any) -> Any:
        loaders = original(*args, **kwargs)
        _record_rows(save_dir, loaded_rows(loaders[0].dataset))
        return loaders

    cli.create_train_val_loaders = create_and_record
    try:
        yield
    finally:
        cli.create_train_val_loaders = original


def _record_rows(save_dir: Path, held: dict[str, Any] | None) -> None:
    import torch.distributed as dist

    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    mine = ({"rank": rank} | held) if held else None
    ranks: list[Any] = [mine]
    if distributed:  # every rank builds its loaders here, so every rank joins the gather
        ranks = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, mine)
    if rank == 0 and all(ranks):
        atomic.write_json(save_dir / TRAINED_ROWS, {"ranks": ranks})


@contextlib.contextmanager
def online_api_key(key: str | None) -> Iterator[None]:
    """speculators 0.9's online dataset builds its client with `api_key="EMPTY"`
    (`train/data.py`), so it cannot reach a server that wants a key: its OpenAI client sends
    `key` instead, for this run. No key: nothing changes."""
    if not key:
        yield
        return
    from speculators.train import data

    real = data.openai

    class _Keyed:
        """speculators' `openai` module, whose OpenAI client presents the run's key."""

        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        @staticmethod
        def OpenAI(*args: Any, **kwargs: Any) -> Any:  # noqa: N802 - openai's name
            return real.OpenAI(*args, **{**kwargs, "api_key": key})

    data.openai = _Keyed()
    try:
        yield
    finally:
        data.openai = real


@contextlib.contextmanager
def lm_head_trainable() -> Iterator[None]:
    """Un-freeze the draft lm_head, which `load_verifier_weights` freezes on every build.

    A training option, not a CPU fix: applies on GPU too. AdamW receives every parameter, so the
    head is optimized once it requires grad; it is saved in model.safetensors and resumed.
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
def hidden_state_noise(std: float, speculator_type: str = "eagle3") -> Iterator[None]:
    """Gaussian noise on the verifier features fed to the drafter, in training steps only.

    Makes the drafter robust to small differences between stored and served features (bf16,
    other kernels, fp8 store). Validation (model.eval()) sees clean features. The noise comes
    from torch's global RNG, which speculators seeds, so runs stay reproducible. The patch is
    on the class of `speculator_type` itself: P-EAGLE overrides EAGLE-3's forward, so a patch
    of EAGLE-3's would never run for it.
    """
    from eagle3_pipeline.training.family_flags import draft_model_class

    model_class = draft_model_class(speculator_type)
    had_own = "forward" in vars(model_class)
    original = model_class.forward

    def noisy_forward(self: Any, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if self.training:
            hidden_states = hidden_states + torch.randn_like(hidden_states) * std
        return original(self, hidden_states, *args, **kwargs)

    model_class.forward = noisy_forward
    try:
        yield
    finally:
        if had_own:
            model_class.forward = original
        else:
            del model_class.forward


class StepControl:
    """Gradient accumulation and the grad-norm record, as scoped patches of speculators' step.

    speculators runs zero_grad, backward, clip, optimizer and scheduler step on every batch.
    With N > 1, zero_grad acts on the first micro-batch of a group, and clip, optimizer and
    scheduler on its last (the N-th, or the epoch's last), after dividing the summed gradients
    by the group's size: a step sees the mean gradient, as with one N times larger batch. The
    scheduler's horizon counts optimizer steps. Metrics and `global_step` stay per micro-batch;
    `grad_norm` is set only on micro-batches that stepped.
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
