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
training batches only.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal, TypedDict

import torch

from eagle3_pipeline.atomic import replace_dir

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
            f"speculators {installed} is installed but eagle3_pipeline.speculators_compat is "
            f"written against {PINNED_SPECULATORS}: install speculators=={PINNED_SPECULATORS} "
            "(constraints/) or re-check the shims and saved layout against the new version"
        )


def apply_cpu_shims() -> None:
    """Make speculators' single-process trainer run on CPU; a no-op where CUDA is available."""
    global _shims_applied
    check_version()
    if _shims_applied or torch.cuda.is_available():
        return
    from speculators.train import checkpointer, trainer

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
    _shims_applied = True


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
) -> None:
    """Train (or resume) a 1-layer Llama EAGLE-3 drafter with speculators' trainer, AdamW.

    `target_layer_ids` are the aux layer ids only (the data's final layer is implied).
    `total_seq_len` is the token budget of one packed batch. `on_metrics` gets every metric
    dict speculators logs (see the module docstring); an exception in it aborts training.
    `train_lm_head` un-freezes the draft lm_head, which speculators always freezes.
    Raises TrainingInterrupted when a signal stopped the run (rerunning resumes).
    """
    if noise_std < 0:
        raise ValueError(f"noise_std={noise_std} must be >= 0")
    _check_layer_count(data_dir, target_layer_ids)
    apply_cpu_shims()
    from speculators.train.cli import main
    from speculators.train.config import TrainConfig

    on_cpu = not torch.cuda.is_available()
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
    if on_cpu:
        # Flex attention and the fused loss need a GPU.
        # fp32 on CPU: bf16 matmuls are emulated here (measured 6x slower per step).
        flags |= {
            "draft_attn_impl": "sdpa",
            "loss_implementation": "eager",
            "hidden_states_dtype": "float32",
        }
    cfg = TrainConfig.from_sources(cli=flags, argv=_as_argv(flags))

    interrupted_model = save_dir / "interrupted" / "model.safetensors"
    stamp_before = _mtime_ns(interrupted_model)
    metrics_logger = logging.getLogger(METRICS_LOGGER)
    tap = _MetricsTap(on_metrics) if on_metrics is not None else None
    if tap is not None:
        # A filter, not a handler: main() reconfigures this logger and drops its handlers,
        # and on the root logger speculators' console handler turns the dict into a string
        # before a later handler sees it. Logger filters survive and run first.
        metrics_logger.addFilter(tap)
    try:
        with (
            _lm_head_trainable() if train_lm_head else contextlib.nullcontext(),
            _hidden_state_noise(noise_std) if noise_std > 0 else contextlib.nullcontext(),
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

    def __init__(self, callback: MetricsCallback) -> None:
        super().__init__()
        self._callback = callback

    def filter(self, record: logging.LogRecord) -> bool:
        step = getattr(record, "step", None)
        if isinstance(record.msg, dict) and step is not None:
            # Not caught here: an exception in the callback stops training.
            self._callback(record.msg, step)
            # Consumed: the callback prints its own plain lines; propagated, the dict would be
            # dumped whole by speculators' console handler at every step.
            return False
        return True


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
