"""train.family: each family's knobs only, EAGLE-3.1 refused by name, and the trainer flags each
family gets (EAGLE-3's exactly as before the families existed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from eagle3_pipeline.drafter.families import FamilyParams
from eagle3_pipeline.errors import ParamsError
from eagle3_pipeline.params import load_params
from eagle3_pipeline.training.family_flags import draft_model_class, trainer_flags


def _load(tmp_path: Path, train: dict[str, Any]) -> Any:
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump({"train": train}))
    return load_params(path)


@pytest.mark.parametrize(
    ("family", "message"),
    [
        ({"name": "eagle3.1"}, "EAGLE-3.1 is neither a speculator type of speculators 0.9.0"),
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
