"""Drafter families the train stage builds with speculators' trainer, and their knobs.

A family is a drafter speculators 0.9 trains and vLLM 0.32 serves, from the same hidden-state
files: `eagle3` (chained drafting: one pass per draft token), `eagle3.1` (EAGLE-3 with the two
norms of the EAGLE-3.1 paper: one per aux layer before fc, `fc_norm`, and the post-norm state
chained to the next step, `norm_output`; speculators' `eagle3` type, vLLM's `eagle3` method,
both reading those config flags), `peagle` (P-EAGLE: EAGLE-3's drafter trained to draft
`num_depths` tokens in one parallel pass) and `dflash` (block diffusion: a small Qwen3-style
stack drafts a block of `block_size` tokens in one non-causal pass). P-EAGLE and DFlash feed a
mask token in the positions they draft, which must be one the verifier never emits
(drafter.mask_token).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

FamilyName = Literal["eagle3", "eagle3.1", "peagle", "dflash"]

# The knobs each family reads; any other knob set on a family is refused (it would be ignored).
KNOBS: dict[str, frozenset[str]] = {
    "eagle3": frozenset(),
    "eagle3.1": frozenset({"fc_norm", "norm_output"}),
    "peagle": frozenset(
        {"mask_token_id", "num_depths", "down_sample_ratio", "down_sample_ratio_min", "max_anchors"}
    ),
    "dflash": frozenset({"mask_token_id", "block_size", "num_layers", "max_anchors"}),
}
# How a family drafts k tokens: one forward pass per token, or all of them in one pass.
DRAFTING: dict[str, Literal["chained", "parallel"]] = {
    "eagle3": "chained",
    "eagle3.1": "chained",
    "peagle": "parallel",
    "dflash": "parallel",
}


class FamilyParams(BaseModel):
    """`train.family` or a `families` entry: a drafter family and the knobs of that family only.

    null knobs keep speculators' defaults (P-EAGLE: 8 depths, COD ratios 0.7 / 0.2; DFlash:
    block 16, 5 layers; both: 512 anchors per sequence) or, for EAGLE-3.1, the paper's
    (fc_norm and norm_output true). mask_token_id null: the tokenizer's mask token, else the
    first embedding row no tokenizer id uses (drafter.mask_token).
    """

    model_config = ConfigDict(extra="forbid")

    name: FamilyName = "eagle3"
    mask_token_id: int | None = Field(None, ge=0)
    num_depths: int | None = Field(None, ge=2)
    down_sample_ratio: float | None = Field(None, gt=0.0, le=1.0)
    down_sample_ratio_min: float | None = Field(None, gt=0.0, le=1.0)
    max_anchors: int | None = Field(None, ge=1)
    block_size: int | None = Field(None, ge=2)
    num_layers: int | None = Field(None, ge=1)
    fc_norm: bool | None = None
    norm_output: bool | None = None

    @model_validator(mode="after")
    def _own_knobs(self) -> FamilyParams:
        for knob in sorted(self.knobs()):
            if knob not in KNOBS[self.name]:
                owners = [f for f, knobs in KNOBS.items() if knob in knobs]
                raise ValueError(
                    f"{knob} is a knob of {' and '.join(owners)}, not of family {self.name}: "
                    f"remove {knob}"
                )
        return self

    def knobs(self) -> dict[str, Any]:
        """The knobs set (not null), by name."""
        return {k: v for k, v in self.model_dump(exclude={"name"}).items() if v is not None}

    @property
    def speculator_type(self) -> str:
        """speculators' `--speculator-type` (and the model class a training step calls)."""
        return "eagle3" if self.name == "eagle3.1" else self.name

    def wiring(self) -> dict[str, bool]:
        """The EAGLE-3 wiring flags (train.flags' names) this family fixes; {}: train.flags'.

        EAGLE-3.1 normalizes each aux layer before fc instead of their concatenation (the two
        are exclusive in speculators and vLLM) and chains the post-norm state.
        """
        if self.name != "eagle3.1":
            return {}
        return {
            "norm_before_fc": False,
            "fc_norm": True if self.fc_norm is None else self.fc_norm,
            "norm_output": True if self.norm_output is None else self.norm_output,
        }

    @property
    def uses_mask_token(self) -> bool:
        return "mask_token_id" in KNOBS[self.name]

    @property
    def drafting(self) -> Literal["chained", "parallel"]:
        return DRAFTING[self.name]

    @property
    def drafts_per_pass(self) -> int | None:
        """Tokens a parallel family was trained to draft in one pass (speculators' defaults
        when unset: 8 depths, block 16); None: chained, as many as asked."""
        if self.name == "peagle":
            return self.num_depths or 8
        if self.name == "dflash":
            return (self.block_size or 16) - 1
        return None


def entry(families: dict[str, FamilyParams], name: str) -> FamilyParams:
    """The `families` entry NAME (`--family NAME`), or one line naming the entries there are."""
    if name not in families:
        from eagle3_pipeline.core.errors import ParamsError

        raise ParamsError(
            f"params.yaml: field 'families': no entry {name!r} (entries: "
            f"{', '.join(families) or 'none'}): add it or fix --family"
        )
    return families[name]


_BRANCH = re.compile(r"[a-z0-9][a-z0-9_-]{0,39}")


def _branch_names(families: dict[str, FamilyParams]) -> dict[str, FamilyParams]:
    for key in families:
        if not _BRANCH.fullmatch(key):
            raise ValueError(
                f"families.{key}: a branch name is a path segment and a DVC stage suffix "
                "(family@NAME): use at most 40 lowercase letters, digits, '_' and '-' (a dot "
                "would nest the params key)"
            )
    return families


# `families`: the further drafters trained beside `train`'s, one DVC branch each (family@NAME),
# from the same store, rows and vocab; each entry is a FamilyParams.
Families = Annotated[dict[str, FamilyParams], AfterValidator(_branch_names)]
