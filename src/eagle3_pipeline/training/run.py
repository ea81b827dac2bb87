"""One run of speculators' own EAGLE-3 trainer, in-process, on CPU as on GPU, from TrainSettings.

We depend on speculators' trainer rather than rewrite it, so its checkpoints are what vLLM loads.
`TrainSettings` is everything a run needs, built once (`from_params`); `build_train_config` turns
it into speculators' TrainConfig and `run_training` runs `main()` inside our scoped patches.
Besides checkpoints (see `checkpoints`), save_dir gets run.yaml and train_command.txt, when
the venv sits inside a git work tree speculators.patch (`git diff HEAD` of that tree), and
trained_rows.json: each rank's count and hash of the rows its training loader held
(data.trained_rows reads it).

Under torchrun (LOCAL_RANK set) each process calls `run_training`; speculators initialises
torch.distributed (gloo on CPU, via the shims), wraps the drafter in DDP or, with `fsdp`, FSDP2,
and gives each rank its own bins of `total_seq_len` tokens (global batch: nproc x that), chosen by
the global RANK (speculators' #619, in 0.9.0). The data order is a
function of seed and epoch (no state to save).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from eagle3_pipeline.config.training_params import TrainParams
from eagle3_pipeline.core.errors import DEBUG_ENV
from eagle3_pipeline.drafter.conventions import RunConventions
from eagle3_pipeline.training import layer_view
from eagle3_pipeline.training.checkpoints import discard_incomplete, exact_resume
from eagle3_pipeline.training.data import check_layer_count
from eagle3_pipeline.training.family_flags import draft_model_class, trainer_flags
from eagle3_pipeline.training.init_from import init_from_checkpoint
from eagle3_pipeline.training.metrics import MetricsCallback, metrics_tap
from eagle3_pipeline.training.online_backend import split_backend_flags
from eagle3_pipeline.training.speculators_patches import (
    StepControl,
    apply_shims,
    hidden_state_noise,
    lm_head_trainable,
    loaded_rows_record,
    no_progress_bars,
    online_api_key,
    own_thread_env,
)
from eagle3_pipeline.training.verifier_init import init_from_verifier


class TrainingInterrupted(KeyboardInterrupt):
    """speculators caught SIGINT/SIGTERM, saved `interrupted/` and returned as if done.

    A KeyboardInterrupt so that `except Exception` cleanup in callers does not swallow it and
    the process exits non-zero.
    """


@dataclass(frozen=True)
class TrainSettings:
    """Everything one run needs: the train params it was given (`train`: every knob, with its one
    default, params') plus the run's resolved paths and data facts.

    `target_layer_ids` are the aux ids only (the data's final layer is implied).
    `train.max_tokens_per_batch` is the token budget of one packed batch per process
    (speculators' total_seq_len). `train.train_lm_head` un-freezes the draft lm_head, which
    speculators always freezes. `fsdp` shards the drafter (torchrun only). `train.init_from` (a
    drafter, flat or speculators format) initialises a fresh run. `metrics_every_steps` is
    speculators' log_freq. The four norm flags and `draft_layer_config` (the init checkpoint's
    decoder layer; None: speculators shapes one like the verifier) are the run's conventions
    (drafter.conventions), which speculators saves in the checkpoint's config.json and export
    passes on.
    """

    train: TrainParams
    data_dir: Path
    verifier_dir: Path
    save_dir: Path
    d2t_path: Path
    t2d_path: Path
    draft_vocab_size: int
    target_layer_ids: list[int]
    train_data_ratio: float
    metrics_every_steps: int = 1
    fsdp: bool = False
    verifier_num_layers: int = 0  # where the verifier's last layer is (train.init_from_verifier)
    norm_before_residual: bool = True
    norm_before_fc: bool = True
    fc_norm: bool = False
    norm_output: bool = True
    draft_layer_config: dict[str, Any] | None = None
    # Online mode: speculators flags (online_training.source.speculators_flags) merged over the
    # store's, and the key of the server they name (sent by speculators' client; never shown).
    online_flags: dict[str, Any] | None = None
    online_api_key: str | None = field(default=None, repr=False)
    # For P-EAGLE and DFlash (train.family), the resolved mask token.
    mask_token_id: int | None = None
    # Where the run's layers (aux, then final) sit in the store's files; None: the files hold
    # exactly them. A store that also holds other families' layers is read through a view.
    store_positions: list[int] | None = None

    @property
    def init_from(self) -> Path | None:
        return Path(self.train.init_from) if self.train.init_from else None

    @property
    def draft_config_file(self) -> Path:
        """Where `draft_layer_config` is written for speculators' --draft-config."""
        return self.save_dir / "draft_layer_config.json"

    @classmethod
    def from_params(
        cls,
        t: TrainParams,
        *,
        data_dir: Path,
        save_dir: Path,
        verifier_dir: Path,
        vocab_dir: Path,
        draft_vocab_size: int,
        conventions: RunConventions,
        train_data_ratio: float,
        nodes: int = 1,
        mask_token_id: int | None = None,
        store_positions: list[int] | None = None,
        verifier_num_layers: int = 0,
    ) -> TrainSettings:
        """The settings of the `train` stage. Every step's metrics reach DVCLive;
        `t.log_every_steps` thins the log lines only (metrics.MetricsSink). `nodes`: training
        nodes, each running t.nproc processes. `mask_token_id`: drafter.mask_token's choice."""
        return cls(
            train=t,
            data_dir=data_dir,
            verifier_dir=verifier_dir,
            save_dir=save_dir,
            d2t_path=vocab_dir / "d2t.npy",
            t2d_path=vocab_dir / "t2d.npy",
            draft_vocab_size=draft_vocab_size,
            target_layer_ids=list(conventions.aux_layer_ids),
            train_data_ratio=train_data_ratio,
            metrics_every_steps=1,
            fsdp=t.strategy == "fsdp" and t.nproc * nodes > 1,
            verifier_num_layers=verifier_num_layers,
            **conventions.flags,
            draft_layer_config=conventions.layer_config,
            mask_token_id=mask_token_id,
            store_positions=store_positions,
        )


def run_training(
    s: TrainSettings,
    on_metrics: MetricsCallback | None,
    on_init_line: Callable[[str], None] = print,
) -> None:
    """Train (or resume) a 1-layer Llama EAGLE-3 drafter with speculators' trainer, AdamW.

    `on_metrics` gets every metric dict speculators logs (see `metrics`); an exception in it
    aborts training. `on_init_line` receives the init_from report. Under torchrun the launcher
    must have called `discard_incomplete` first (a rank deleting directories while another lists
    them races). Raises TrainingInterrupted when a signal stopped the run (rerunning resumes).
    """
    _check(s)
    t = s.train
    apply_shims()
    if "LOCAL_RANK" not in os.environ:
        discard_incomplete(s.save_dir)
    from speculators.train.cli import main

    _write_draft_config(s)
    cfg = build_train_config(s)
    interrupted_model = s.save_dir / "interrupted" / "model.safetensors"
    stamp_before = _mtime_ns(interrupted_model)
    steps = StepControl(t.grad_accumulation)
    nothing = contextlib.nullcontext()
    with (
        metrics_tap(on_metrics, lambda: steps.grad_norm),
        lm_head_trainable() if t.train_lm_head else nothing,
        hidden_state_noise(t.noise_std, t.family.speculator_type) if t.noise_std > 0 else nothing,
        exact_resume(t.keep_last, exact=not s.fsdp),
        steps.patched(),
        no_progress_bars() if os.environ.get("TQDM_DISABLE") else nothing,
        online_api_key(s.online_api_key),  # online mode's server key, if any
        quiet_request_logs(),
        own_thread_env(),
        loaded_rows_record(s.save_dir),
        init_from_verifier(
            t.init_from_verifier,
            s.verifier_dir,
            s.verifier_num_layers,
            s.save_dir,
            on_init_line,
        ),
        # Last: inside the lm_head un-freezing, after exact_resume tidied the scratch dir.
        init_from_checkpoint(
            s.init_from,
            t.init_vocab_mismatch,
            s.save_dir,
            on_init_line,
            run_mapping=str(s.d2t_path.parent),
        ),
    ):
        main(cfg)

    last_epoch_model = s.save_dir / str(t.epochs - 1) / "model.safetensors"
    if _mtime_ns(interrupted_model) != stamp_before or not last_epoch_model.is_file():
        raise TrainingInterrupted(
            f"training stopped by a signal before epoch {t.epochs} finished (speculators saves "
            f"to {s.save_dir / 'interrupted'}); rerun to resume from the last complete epoch"
        )


def untrained_val(s: TrainSettings, scratch: Path) -> dict[str, float]:
    """The val metrics of the untrained twin: the drafter speculators builds at step 0 from
    these settings (no init checkpoint), measured by speculators' own validation loop on the
    run's val rows, keyed as in a trained run's val record (without "_epoch").

    A trained drafter that does not beat its twin has learned nothing. `scratch` (emptied)
    takes speculators' run files; nothing is trained or saved.
    """
    import shutil

    from speculators.train.cli import main
    from speculators.train.trainer import Trainer

    apply_shims()
    shutil.rmtree(scratch, ignore_errors=True)
    train = s.train.model_copy(update={"init_from": None})
    twin = dataclasses.replace(s, train=train, save_dir=scratch, online_flags=None)
    _write_draft_config(twin)
    found: dict[str, float] = {}

    def validate_only(trainer: Any) -> None:
        found.update(trainer.val_epoch(0) or {})

    original = Trainer.run_training
    Trainer.run_training = validate_only  # type: ignore[method-assign]
    try:
        with own_thread_env():
            main(build_train_config(twin))
    finally:
        Trainer.run_training = original  # type: ignore[method-assign]
    shutil.rmtree(scratch, ignore_errors=True)
    return {k.removesuffix("_epoch"): float(v) for k, v in found.items()}


def initial_drafter(s: TrainSettings, on_init_line: Callable[[str], None] = print) -> Any:
    """The drafter speculators' trainer starts from (step 0): built by its own
    `build_draft_model` from these settings, with the same init and lm_head patches."""
    apply_shims()
    from speculators.train.cli import build_draft_model, parse_vocab_mappings

    _write_draft_config(s)
    args = argparse.Namespace(**build_train_config(s).flatten())
    d2t, t2d, draft_vocab_size = parse_vocab_mappings(args)
    t = s.train
    model_class = draft_model_class(t.family.speculator_type)
    with (
        lm_head_trainable() if t.train_lm_head else contextlib.nullcontext(),
        init_from_checkpoint(
            s.init_from, t.init_vocab_mismatch, s.save_dir, on_init_line, str(s.d2t_path.parent)
        ),
    ):
        return build_draft_model(args, model_class, t2d, d2t, draft_vocab_size)


def _write_draft_config(s: TrainSettings) -> None:
    if s.draft_layer_config is not None:
        s.save_dir.mkdir(parents=True, exist_ok=True)
        s.draft_config_file.write_text(json.dumps(s.draft_layer_config, indent=2) + "\n")


def _check(s: TrainSettings) -> None:
    """Refuse settings speculators would accept and then fail on, or silently misuse."""
    t = s.train
    if t.noise_std < 0:
        raise ValueError(f"noise_std={t.noise_std} must be >= 0")
    if t.grad_accumulation < 1:
        raise ValueError(f"grad_accumulation={t.grad_accumulation} must be >= 1")
    if t.keep_last is not None and t.keep_last < 1:
        raise ValueError(f"keep_last={t.keep_last} must be >= 1 (or None: keep every epoch)")
    if s.fsdp and "LOCAL_RANK" not in os.environ:
        raise ValueError("fsdp shards the drafter across processes: launch with torchrun")
    check_layer_count(s.data_dir, s.target_layer_ids, s.store_positions)


@contextlib.contextmanager
def quiet_request_logs() -> Any:
    """httpx logs every request at INFO: online, one 3-line entry per sample fetched (9 million
    lines at 600k samples x 5 epochs), burying the progress lines. A failed request still reads
    in one line: speculators' recovery names each failed round trip, and a lasting failure ends
    the stage with its error. `--debug` (DEBUG_ENV, which torchrun ranks inherit) keeps them."""
    if os.environ.get(DEBUG_ENV) == "1":
        yield
        return
    # openai 3 (speculators' online client) sends through httpx2, which logs as "httpx2"
    names = ("httpx", "httpcore", "httpx2", "httpcore2")
    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def build_train_config(s: TrainSettings) -> Any:
    """speculators' TrainConfig for these settings (also what `speculators train` would get)."""
    from speculators.train.config import TrainConfig

    t = s.train
    family = trainer_flags(t.family, s.mask_token_id)
    # EAGLE-3's wiring flags; DFlash has none of them (its decoder is its own).
    wiring = {
        "norm_before_residual": s.norm_before_residual,
        "norm_before_fc": s.norm_before_fc,
        "fc_norm": s.fc_norm,
        "norm_output": s.norm_output,
    }
    flags: dict[str, Any] = {
        "speculator_type": family.pop("speculator_type"),
        "seed": t.seed,
        "verifier_name_or_path": str(s.verifier_dir),
        "target_layer_ids": list(s.target_layer_ids),
        **(wiring if t.family.name != "dflash" else {}),
        "draft_vocab_size": s.draft_vocab_size,
        "d2t_path": str(s.d2t_path),
        "t2d_path": str(s.t2d_path),
        # Explicit even for EAGLE-3 (which never reads it), so speculators loads no tokenizer.
        "mask_token_id": family.pop("mask_token_id"),
        "data_path": str(s.data_dir),
        # Reads bf16 files as they are and dequantizes fp8 files that carry scales.
        "hidden_states_backend": "fp8",
        # The default, "generate", would ask a vLLM server for a missing file.
        "on_missing": "raise",
        "total_seq_len": t.max_tokens_per_batch,
        "train_data_ratio": s.train_data_ratio,
        "num_workers": t.num_workers,
        "ttt_steps": t.ttt_steps,
        "ttt_step_loss_decay": t.ttt_step_loss_decay,
        "optimizer": "adamw",
        "lr": t.lr,
        "scheduler_type": t.scheduler,
        "scheduler_warmup_ratio": t.warmup_ratio,
        "epochs": t.epochs,
        "save_path": str(s.save_dir),
        "log_freq": s.metrics_every_steps,
        **family,  # the family's own knobs (none for EAGLE-3)
    }
    if s.draft_layer_config is not None:
        # The init checkpoint's decoder layer (heads, sizes, rope, eps), not one shaped like the
        # verifier: its tensors only load, and mean what they meant, in that layer.
        flags["draft_config"] = str(s.draft_config_file)
    elif t.family.name != "dflash":
        flags |= {"draft_arch": "llama", "num_layers": 1}
    # DFlash: speculators' recipe (a Qwen3-style stack of 5 layers) unless num_layers is set.
    if s.fsdp:
        flags["fsdp_shard"] = True
    if s.online_flags:
        flags |= s.online_flags
    if flags["hidden_states_backend"] == "fp8":  # files read here (Mooncake caches none)
        flags |= layer_view.flags(s.store_positions)
    if not torch.cuda.is_available():
        # Flex attention and the fused loss need a GPU. The autocast dtype is train.cpu_dtype:
        # bf16 is 1.3x faster per step where the CPU has bf16 instructions (avx512_bf16) and
        # several times slower where it emulates them.
        flags |= {
            "draft_attn_impl": "sdpa",
            "loss_implementation": "eager",
            "hidden_states_dtype": t.cpu_dtype,
        }
    # A backend's own flags (mooncake_*) bypass speculators' schema: in `cli` they would be
    # dropped without a word (online_backend.split_backend_flags).
    cli, backend_cli = split_backend_flags(flags)
    return TrainConfig.from_sources(cli=cli, backend_cli=backend_cli, argv=_as_argv(flags))


def _as_argv(flags: dict[str, Any]) -> list[str]:
    """The equivalent `speculators train` command, recorded in train_command.txt."""
    argv = ["speculators", "train"]
    for key, value in flags.items():
        values = value if isinstance(value, list) else [value]
        argv += [f"--{key.replace('_', '-')}", *map(str, values)]
    return argv


def _mtime_ns(path: Path) -> int | None:
    return path.stat().st_mtime_ns if path.exists() else None
