"""What a finished run leaves as DVC outputs: its best and final checkpoints, its DVCLive series
and its metrics file, for the `train` stage or a `family@NAME` branch (docs/families.md)."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from eagle3_pipeline.config.families import FamilyParams
from eagle3_pipeline.core import atomic, paths
from eagle3_pipeline.core.progress import log
from eagle3_pipeline.training.checkpoints import best_checkpoint
from eagle3_pipeline.training.metrics import read_summary, simulated_tau

CHECKPOINT_FILES = ("config.json", "model.safetensors")


@dataclass(frozen=True)
class Outputs:
    """Where a run publishes, and the stage name its log lines and records carry."""

    stage: str = "train"
    trained: Path = paths.TRAINED
    live: Path = paths.TRAIN_LIVE
    metrics: Path = paths.TRAIN_METRICS
    family_key: str = "train.family"  # where params.yaml holds the run's family
    # Measure the untrained twin (run.untrained_val) beside it: a branch must beat its own.
    twin: bool = False

    @classmethod
    def of_family(cls, name: str) -> Outputs:
        return cls(
            f"family@{name}",
            paths.FAMILIES_MODELS / name,
            paths.FAMILIES_METRICS / name / "train",
            paths.FAMILIES_METRICS / name / "train.json",
            f"families.{name}",
            twin=True,
        )

    @classmethod
    def of_fraction(cls, fraction: float) -> Outputs:
        """A learning-curve point: train's drafter on a nested fraction of its rows."""
        return cls(
            f"curve_train@{fraction}",
            paths.CURVE_MODELS / str(fraction),
            paths.CURVE_FRACTIONS / str(fraction) / "train",
            paths.CURVE_FRACTIONS / str(fraction) / "train.json",
        )


def publish(
    out: Outputs,
    run_live: Path,
    save_dir: Path,
    epochs: int,
    family: FamilyParams,
    twin: dict[str, float] | None = None,
    trained: dict[str, object] | None = None,
) -> None:
    """Copy the run's best and final checkpoints and its DVCLive series into `out`.

    Besides the val metrics as speculators names them, the metrics file holds `drafter`: the
    family and its per-position val accuracy numbered alike for every family (1 = the first
    drafted token), so `dvc metrics show` compares the families in one table; with `twin`
    (the untrained twin's val metrics, run.untrained_val) the same measures of the twin. With
    `trained` ({train_rows, train_ids_hash}: data.trained_rows) what the run's loaders held.
    """
    summary = read_summary(run_live)
    shutil.rmtree(out.live, ignore_errors=True)
    shutil.copytree(run_live, out.live)
    best = best_checkpoint(save_dir)
    with atomic.replace_dir(out.trained) as tmp:
        _copy_checkpoint(best, tmp / "best")
        _copy_checkpoint(save_dir / str(epochs - 1), tmp / "final")
        atomic.write_json(tmp / "summary.json", {"best_epoch": int(best.name), "epochs": epochs})
    val = {k: round(v, 6) for k, v in summary.get("val", {}).items()}
    record = {"best_epoch": int(best.name), "val_at_last_epoch": val} | (trained or {})
    if out.stage != "train" or family != FamilyParams():
        record["drafter"] = comparable(family, val)
    if twin is not None:
        record["drafter"]["untrained_twin"] = twin_measures(family, twin, out.stage)
    atomic.write_json(out.metrics, record)
    log(out.stage, f"best epoch {best.name} -> {out.trained}/best, final -> {out.trained}/final")


def comparable(family: FamilyParams, val: dict[str, float]) -> dict[str, object]:
    """{family, drafting, val accuracy by draft position from 1, acceptance length if reported}.

    EAGLE-3 logs full_acc_k (k from 0), P-EAGLE position_k_acc by depth (from 0), DFlash
    position_k_acc by block slot (from 1: slot 0 is the anchor, a verifier token).
    """
    first = 1 if family.name == "dflash" else 0
    accs: dict[str, float] = {}
    for key, value in val.items():
        k = _position(key)
        if k is not None:
            accs[str(k - first + 1)] = value
    found = {"family": family.name, "drafting": family.drafting}
    found["val_accuracy_by_position"] = dict(sorted(accs.items(), key=lambda kv: int(kv[0])))
    if "acceptance_length" in val:
        found["val_acceptance_length"] = val["acceptance_length"]
    return found


def twin_measures(family: FamilyParams, twin: dict[str, float], stage: str) -> dict[str, object]:
    """The untrained twin's val measures as `comparable` names them (its acceptance length
    derived as a trained run's is), and one log line of them."""
    positions = sum(1 for k in twin if _position(k) is not None)
    tau = simulated_tau(twin, positions)
    found = comparable(family, twin | ({"acceptance_length": tau} if tau is not None else {}))
    accs = " ".join(f"{k}: {v:.3f}" for k, v in found["val_accuracy_by_position"].items())
    log(stage, f"untrained twin: val accuracy by draft position {accs}")
    return {k: v for k, v in found.items() if k.startswith("val_")}


def _position(key: str) -> int | None:
    if key.startswith("full_acc_"):
        return int(key.removeprefix("full_acc_"))
    if key.startswith("position_") and key.endswith("_acc"):
        return int(key.split("_")[1])
    return None


def _copy_checkpoint(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True)
    for name in CHECKPOINT_FILES:
        shutil.copy2(src / name, dst / name)
