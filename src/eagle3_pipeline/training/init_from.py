"""Initialise training from a published drafter (`train.init_from`), flat or speculators format.

speculators 0.9.0 builds the drafter from the verifier (`Eagle3DraftModel.from_training_args`,
which ends with `load_verifier_weights`); `init_from_checkpoint` hooks that last call, for one
`main()`, and copies the checkpoint's tensors onto the model before the trainer sees it. Its own
`--from-pretrained` is not used: it cannot read the flat format, and it would pair the
checkpoint's lm_head rows with this run's d2t. When the run resumes (speculators finds an epoch
directory in save_dir and loads it after building the model), nothing is applied: the resumed
weights are the run's, and an init would only cost a multi-GB read.

Vocab safety: lm_head row i predicts target token i + d2t[i]. When the checkpoint's mapping
differs from the run's (data/vocab), rows are moved by target id: a token in both keeps its
trained row, a token new to the draft vocab starts from the verifier's lm_head row of that
target id, a token that left is dropped (`remap`); or the run stops naming both mappings
(`refuse`). Rows are never paired with other ids.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from eagle3_pipeline.core import paths
from eagle3_pipeline.core.errors import CheckpointError
from eagle3_pipeline.drafter.flat_format import FLAGS, DrafterCheckpoint, open_checkpoint
from eagle3_pipeline.training.checkpoints import resume_epoch

VOCAB_TENSORS = ("d2t", "t2d")
# Loaded by speculators from the verifier itself (embed_tokens only when the checkpoint has none).
VERIFIER_TENSORS = ("verifier_lm_head.weight", "verifier_norm.weight", "embed_tokens.weight")


@dataclass
class InitReport:
    """What `apply_init` did, by tensor name, and the model's parameter counts afterwards."""

    source: str
    format: str
    loaded: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # name -> why
    new: list[str] = field(default_factory=list)  # initialised by the model, not the checkpoint
    from_verifier: list[str] = field(default_factory=list)
    lm_head: str = ""
    rows_kept: int = 0
    rows_dropped: int = 0
    rows_new: int = 0
    total: int = 0
    trainable: int = 0
    frozen: int = 0
    notes: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        skipped = [f"{k} ({why})" for k, why in self.skipped.items()]
        return [
            f"init_from {self.source} ({self.format} format): loaded {len(self.loaded)} tensors "
            f"{self.loaded}",
            f"skipped {len(skipped)}: {skipped}",
            f"newly initialised {len(self.new)}: {self.new}; from the verifier "
            f"{len(self.from_verifier)}: {self.from_verifier}",
            f"lm_head: {self.lm_head}",
            f"parameters: {self.total:,} total, {self.trainable:,} trainable, "
            f"{self.frozen:,} frozen",
            *self.notes,
        ]


def _target_ids(d2t: torch.Tensor | None, n_draft: int) -> torch.Tensor:
    """Target token id of each draft row (d2t holds offsets: target = draft + d2t[draft])."""
    base = torch.arange(n_draft, dtype=torch.long)
    return base if d2t is None else base + d2t.long()


def _checkpoint_target_ids(ckpt: DrafterCheckpoint, n_rows: int) -> torch.Tensor:
    names = set(ckpt.names())
    where = f"{ckpt.path}/model weights"
    if "d2t" not in names:
        if n_rows != ckpt.target_vocab_size:
            raise CheckpointError(
                f"{where}: lm_head has {n_rows} rows but no d2t says which target token each "
                f"predicts (target vocab {ckpt.target_vocab_size}): use a checkpoint with d2t"
            )
        return torch.arange(n_rows, dtype=torch.long)
    ids = _target_ids(ckpt.tensor("d2t"), ckpt.shape("d2t")[0])
    if len(ids) != n_rows:
        raise CheckpointError(f"{where}: d2t has {len(ids)} entries but lm_head {n_rows} rows")
    if "t2d" in names:
        t2d = ckpt.tensor("t2d").bool()
        if not torch.equal(t2d.nonzero().flatten(), ids.sort().values):
            raise CheckpointError(
                f"{where}: its d2t and t2d name different target tokens: the checkpoint is "
                "corrupt or hand-edited; re-export it"
            )
    return ids


def _check_shapes(ckpt: DrafterCheckpoint, model: Any, run_mapping: str) -> None:
    """Refuse the three mismatches that make a checkpoint belong to another verifier."""
    where = f"{ckpt.path}/config.json"
    if ckpt.hidden_size != model.hidden_size:
        raise CheckpointError(
            f"{where}: hidden_size {ckpt.hidden_size} but this run's verifier has "
            f"{model.hidden_size}: train.init_from must be a drafter for this verifier"
        )
    if "fc.weight" in ckpt.names():
        width = ckpt.shape("fc.weight")[1]
        run_width = model.fc.weight.shape[1]
        if width != run_width:
            n_ckpt = width // ckpt.target_hidden_size
            n_run = len(model.config.eagle_aux_hidden_state_layer_ids or [])
            raise CheckpointError(
                f"{where}: fc takes {width} inputs ({n_ckpt} aux layers x "
                f"{ckpt.target_hidden_size}) but this run feeds {run_width} ({n_run} aux layers "
                f"x {model.hidden_size}): set layers.aux_layer_ids to {n_ckpt} ids"
            )
    target_vocab = ckpt.shape("t2d")[0] if "t2d" in ckpt.names() else ckpt.target_vocab_size
    if target_vocab != model.verifier_vocab_size:
        raise CheckpointError(
            f"{where}: target vocab {target_vocab} but this run's verifier has "
            f"{model.verifier_vocab_size} ({run_mapping}): train.init_from must be a drafter "
            "for this verifier's tokenizer"
        )


def apply_init(
    model: Any,
    init_from: str | Path,
    mismatch: Literal["remap", "refuse"],
    run_mapping: str = str(paths.VOCAB),
) -> InitReport:
    """Copy a drafter checkpoint onto a freshly built Eagle3DraftModel, in place.

    `model` has its run mapping (`load_vocab_mappings`) and verifier weights
    (`load_verifier_weights`) loaded, as speculators leaves it. `run_mapping` names the run's
    mapping in messages. Raises CheckpointError (one line) before changing anything.
    """
    ckpt = open_checkpoint(init_from)
    _check_shapes(ckpt, model, run_mapping)
    report = InitReport(source=str(init_from), format=ckpt.format)
    state = model.state_dict()
    params = dict(model.named_parameters())
    # name -> tensor, or None: read from the checkpoint at copy time (one tensor in memory at a
    # time; a Kimi drafter is ~3 GB). Every check runs before the first copy.
    plan: dict[str, torch.Tensor | None] = {}
    for name in ckpt.names():
        if name in VOCAB_TENSORS:
            report.skipped[name] = f"this run's {run_mapping} mapping is used"
        elif name == "lm_head.weight":
            continue
        elif name in VERIFIER_TENSORS[:2]:
            report.skipped[name] = "taken from the verifier"
        elif name not in state:
            report.skipped[name] = "not a parameter of speculators' Eagle3DraftModel"
        elif ckpt.shape(name) != list(state[name].shape):
            raise CheckpointError(
                f"{ckpt.path}: tensor {name} has shape {ckpt.shape(name)} but this run's drafter "
                f"needs {list(state[name].shape)}: train.init_from must have the drafter shape "
                "speculators builds for this verifier"
            )
        else:
            plan[name] = None

    head = model.lm_head.weight
    if "lm_head.weight" in ckpt.names():
        ck_head = ckpt.tensor("lm_head.weight")
        if ck_head.shape[1] != head.shape[1]:
            raise CheckpointError(
                f"{ckpt.path}: lm_head.weight has shape {list(ck_head.shape)}; this run's rows "
                f"have {head.shape[1]} columns"
            )
        ck_ids = _checkpoint_target_ids(ckpt, ck_head.shape[0])
        run_ids = _target_ids(model.d2t, head.shape[0])
        same = len(ck_ids) == len(run_ids) and torch.equal(ck_ids, run_ids.cpu())
        if same:
            plan["lm_head.weight"] = ck_head
            report.lm_head = f"{len(run_ids)} rows loaded (same vocab mapping as {run_mapping})"
        else:
            plan["lm_head.weight"] = _remapped_head(
                model, ckpt, ck_head, ck_ids, run_ids, mismatch, run_mapping, report
            )
    else:
        report.lm_head = "none in the checkpoint: the verifier's lm_head rows"

    with torch.no_grad():
        for name, tensor in plan.items():
            source = ckpt.tensor(name) if tensor is None else tensor
            target = params[name] if name in params else state[name]
            target.copy_(source.to(device=target.device, dtype=target.dtype))
    report.loaded = sorted(plan)
    owned_by_verifier = set(VERIFIER_TENSORS) - set(plan)
    report.from_verifier = sorted(n for n in params if n in owned_by_verifier)
    report.new = sorted(n for n in params if n not in plan and n not in owned_by_verifier)
    if "lm_head.weight" not in ckpt.names():
        report.from_verifier.append("lm_head.weight")
        report.new.remove("lm_head.weight")
    report.total = sum(p.numel() for p in model.parameters())
    report.trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    report.frozen = report.total - report.trainable
    report.notes = _notes(ckpt, model)
    return report


def _remapped_head(
    model: Any,
    ckpt: DrafterCheckpoint,
    ck_head: torch.Tensor,
    ck_ids: torch.Tensor,
    run_ids: torch.Tensor,
    mismatch: str,
    run_mapping: str,
    report: InitReport,
) -> torch.Tensor:
    """lm_head rows moved by target id; verifier rows for tokens new to the draft vocab."""
    n_target = model.verifier_vocab_size
    row_of = torch.full((n_target,), -1, dtype=torch.long)
    row_of[ck_ids] = torch.arange(len(ck_ids))
    source = row_of[run_ids.cpu()]
    kept = source >= 0
    n_kept = int(kept.sum())
    if mismatch == "refuse":
        raise CheckpointError(
            f"vocab mappings differ: {ckpt.path} (d2t, draft vocab {len(ck_ids)}) vs this run's "
            f"{run_mapping}/d2t.npy (draft vocab {len(run_ids)}; {n_kept} tokens in both): its "
            "lm_head rows would predict other tokens; set train.init_vocab_mismatch: remap, or "
            f"build {run_mapping} from the checkpoint's d2t/t2d"
        )
    verifier_rows = model.verifier_lm_head.weight.detach().cpu()
    if torch.isnan(verifier_rows[~kept]).any():
        raise CheckpointError(
            f"{ckpt.path}: remapping lm_head needs the verifier's lm_head rows, which are not "
            "loaded: build the model with its verifier (speculators_config.verifier)"
        )
    head = verifier_rows.clone()
    head[kept] = ck_head[source[kept]].to(head.dtype)
    report.rows_kept = n_kept
    report.rows_new = len(run_ids) - n_kept
    report.rows_dropped = len(ck_ids) - n_kept
    report.lm_head = (
        f"rows remapped by target id ({ckpt.path} draft vocab {len(ck_ids)} -> {run_mapping} "
        f"draft vocab {len(run_ids)}): {report.rows_kept} kept, {report.rows_dropped} dropped, "
        f"{report.rows_new} new from the verifier's lm_head"
    )
    return head


def _notes(ckpt: DrafterCheckpoint, model: Any) -> list[str]:
    """Differences that do not stop the run but change what the loaded weights compute."""
    notes = []
    run_flags = {k: bool(getattr(model.config, k, False)) for k in FLAGS}
    if run_flags != ckpt.flags:
        diff = ", ".join(
            f"{k} {ckpt.flags[k]} -> {run_flags[k]}" for k in FLAGS if run_flags[k] != ckpt.flags[k]
        )
        notes.append(
            f"note: the checkpoint was trained with other norm flags ({diff}): its weights start "
            "a differently wired drafter, not the same function"
        )
    ck_aux = ckpt.vllm_aux_layer_ids
    run_aux = list(model.config.eagle_aux_hidden_state_layer_ids or [])
    if ck_aux is not None and ck_aux != run_aux:
        origin = (
            f" (written {ckpt.aux_layer_ids} in SGLang's convention)"
            if ckpt.convention == "sglang"
            else ""
        )
        notes.append(
            f"note: the checkpoint's fc was trained on aux layers {ck_aux} in vLLM's convention"
            f"{origin}; this run feeds {run_aux}"
        )
    return notes


@contextlib.contextmanager
def init_from_checkpoint(
    init_from: str | Path | None,
    mismatch: Literal["remap", "refuse"],
    save_dir: str | Path,
    on_line: Callable[[str], None],
    run_mapping: str = str(paths.VOCAB),
) -> Iterator[list[InitReport]]:
    """Apply `apply_init` to the drafter speculators builds inside this block (once).

    Enter it INSIDE any other patch of `Eagle3DraftModel.load_verifier_weights` (e.g. the
    lm_head un-freezing) so that the reported trainable counts include that patch. Yields the
    list that receives the report. A no-op when init_from is None or the run resumes.
    """
    reports: list[InitReport] = []
    if init_from is None:
        yield reports
        return
    epoch = resume_epoch(save_dir)
    if epoch is not None:
        on_line(
            f"init_from {init_from} not applied: resuming from {Path(save_dir) / str(epoch)}, "
            "whose weights speculators loads"
        )
        yield reports
        return
    open_checkpoint(init_from)  # a wrong path fails now, not after the data is loaded
    from speculators.models.eagle3.core import Eagle3DraftModel

    original = Eagle3DraftModel.load_verifier_weights

    def load_then_init(self: Any) -> None:
        original(self)
        if not reports:
            report = apply_init(self, init_from, mismatch, run_mapping)
            reports.append(report)
            for line in report.lines():
                on_line(line)

    Eagle3DraftModel.load_verifier_weights = load_then_init
    try:
        yield reports
    finally:
        Eagle3DraftModel.load_verifier_weights = original
