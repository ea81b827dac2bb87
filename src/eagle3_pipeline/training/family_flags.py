"""A family's flags for speculators' trainer, and the model class its training steps call.

Training code, apart from the schema (config/families.py, a params dependency of every stage), so
that editing it reruns train only.
"""

from __future__ import annotations

from typing import Any

from eagle3_pipeline.config.families import FamilyParams


def trainer_flags(family: FamilyParams, mask_token_id: int | None) -> dict[str, Any]:
    """speculators train flags of the family: its type, its knobs, the resolved mask token.

    EAGLE-3 keeps the flags train always passed (mask token 0, which EAGLE-3 never reads, so
    that speculators loads no tokenizer): its runs and checkpoints stay as they were.
    """
    flags: dict[str, Any] = {"speculator_type": family.speculator_type}
    # EAGLE-3.1's knobs are wiring: they reach speculators as train's flags, through the run's
    # conventions (build_train_config); the mask token is resolved below.
    skip = {"mask_token_id", *family.wiring()}
    flags |= {k: v for k, v in family.knobs().items() if k not in skip}
    if family.uses_mask_token:
        if mask_token_id is None:
            raise ValueError(f"family {family.name} needs a resolved mask token id")
        flags["mask_token_id"] = mask_token_id
    else:
        flags["mask_token_id"] = 0
    return flags


def draft_model_class(speculator_type: str) -> type:
    """speculators' model class of a type (the one whose forward a training step calls)."""
    from speculators.model import SpeculatorModel

    registry = SpeculatorModel.registry or {}
    if speculator_type not in registry:
        raise ValueError(
            f"speculators has no drafter type {speculator_type!r} (known: {sorted(registry)})"
        )
    return registry[speculator_type]
