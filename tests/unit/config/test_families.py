"""train.family: each family's knobs only, the trainer flags each family gets (EAGLE-3's exactly
as before the families existed), and EAGLE-3.1's wiring reaching the run's conventions."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from eagle3_pipeline.config.families import FamilyParams
from eagle3_pipeline.config.params import Params, load_params
from eagle3_pipeline.core.errors import ParamsError
from eagle3_pipeline.drafter.conventions import resolve
from eagle3_pipeline.stages.train import family_branch
from eagle3_pipeline.training.family_flags import draft_model_class, trainer_flags


def _load(tmp_path: Path, train: dict[str, Any]) -> Any:
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump({"train": train}))
    return load_params(path)


@pytest.mark.parametrize(
    ("family", "message"),
    [
        (
            {"name": "eagle3", "fc_norm": True},
            "fc_norm is a knob of eagle3.1, not of family eagle3: remove fc_norm",
        ),
        ({"name": "peagle", "norm_output": False}, "norm_output is a knob of eagle3.1"),
        ({"name": "medusa"}, "'train.family.name'"),
        ({"name": "eagle3", "mask_token_id": 5}, "mask_token_id is a knob of peagle and dflash"),
        (
            {"name": "peagle", "block_size": 4},
            "block_size is a knob of dflash, not of family peagle",
        ),
        ({"name": "dflash", "num_depths": 4}, "'train.family': num_depths is a knob of peagle"),
        ({"name": "dflash", "block_size": 1}, "'train.family.block_size'"),
    ],
)
def test_bad_family_is_one_line(tmp_path: Path, family: dict, message: str) -> None:
    with pytest.raises(ParamsError, match=message) as err:
        _load(tmp_path, {"family": family})
    assert "\n" not in str(err.value) and str(tmp_path / "params.yaml") in str(err.value)


def test_init_from_is_eagle3_only(tmp_path: Path) -> None:
    with pytest.raises(ParamsError, match="family peagle trains from scratch"):
        _load(tmp_path, {"init_from": "models/published", "family": {"name": "peagle"}})


def test_knobs_and_drafting() -> None:
    p = FamilyParams(name="peagle", num_depths=4, mask_token_id=7)
    assert p.knobs() == {"num_depths": 4, "mask_token_id": 7}
    assert (p.drafting, FamilyParams().drafting) == ("parallel", "chained")
    assert not FamilyParams().uses_mask_token and FamilyParams(name="dflash").uses_mask_token
    assert (FamilyParams(name="dflash").drafts_per_pass, p.drafts_per_pass) == (15, 4)
    assert (
        FamilyParams(name="peagle").drafts_per_pass == 8 and FamilyParams().drafts_per_pass is None
    )


def test_trainer_flags() -> None:
    assert trainer_flags(FamilyParams(), None) == {"speculator_type": "eagle3", "mask_token_id": 0}
    dflash = FamilyParams(name="dflash", block_size=4, num_layers=2, mask_token_id=9)
    assert trainer_flags(dflash, 9) == {
        "speculator_type": "dflash",
        "block_size": 4,
        "num_layers": 2,
        "mask_token_id": 9,
    }
    with pytest.raises(ValueError, match="needs a resolved mask token"):
        trainer_flags(FamilyParams(name="peagle"), None)
    with pytest.raises(ValueError, match="no drafter type 'eagle4'"):
        draft_model_class("eagle4")


def test_eagle3_1_is_eagle3_with_its_wiring() -> None:
    """speculators' eagle3 type, chained, no mask token; its knobs are wiring, not trainer
    flags (they reach speculators through the conventions, below)."""
    e31 = FamilyParams(name="eagle3.1")
    assert (e31.speculator_type, e31.drafting, e31.uses_mask_token) == ("eagle3", "chained", False)
    assert e31.wiring() == {"norm_before_fc": False, "fc_norm": True, "norm_output": True}
    ablated = FamilyParams(name="eagle3.1", norm_output=False)
    assert ablated.wiring()["norm_output"] is False and ablated.knobs() == {"norm_output": False}
    assert trainer_flags(ablated, None) == {"speculator_type": "eagle3", "mask_token_id": 0}
    assert FamilyParams().wiring() == {} and FamilyParams(name="peagle").wiring() == {}


def test_eagle3_1_branch_sets_its_flags_over_train_flags() -> None:
    """A families branch shares train.flags with train's drafter: an eagle3.1 branch takes the
    paper's norms over them (and says so), keeps the others, and train's drafter keeps its own."""
    flags = {"norm_before_residual": False, "norm_before_fc": True, "norm_output": False}
    params = Params.model_validate(
        {"train": {"flags": flags}, "families": {"e31": {"name": "eagle3.1"}}}
    )
    branch, _ = family_branch(params, "e31")
    conv = resolve(branch.layers, branch.train, 8, None)
    assert conv.flags == {
        "norm_before_residual": False,
        "norm_before_fc": False,
        "fc_norm": True,
        "norm_output": True,
    }
    assert conv.sources["fc_norm"] == "family eagle3.1"
    assert conv.sources["norm_before_residual"] == "params"
    assert resolve(params.layers, params.train, 8, None).flags == flags | {"fc_norm": False}
