"""A run's published outputs: the train stage's as before, a branch's with a comparable summary."""

from __future__ import annotations

from pathlib import Path

import pytest

from eagle3_pipeline.config.families import FamilyParams
from eagle3_pipeline.config.params import Params
from eagle3_pipeline.core import paths
from eagle3_pipeline.core.errors import ParamsError
from eagle3_pipeline.stages.train import family_branch
from eagle3_pipeline.training.publish import Outputs, comparable, twin_measures


def test_positions_are_numbered_alike_for_every_family() -> None:
    eagle3 = {"loss": 1.0, "full_acc_0": 0.6, "full_acc_1": 0.4, "cond_acc_0": 0.6}
    eagle3["acceptance_length"] = 1.9
    peagle = {"loss": 0.1, "full_acc": 0.3, "position_0_acc": 0.5, "position_1_acc": 0.2}
    dflash = {"loss": 2.0, "position_1_acc": 0.5, "position_2_acc": 0.2, "eal": 1.6}
    dflash["acceptance_length"] = 1.6
    assert comparable(FamilyParams(), eagle3) == {
        "family": "eagle3",
        "drafting": "chained",
        "val_accuracy_by_position": {"1": 0.6, "2": 0.4},
        "val_acceptance_length": 1.9,
    }
    got = comparable(FamilyParams(name="peagle"), peagle)
    assert got["val_accuracy_by_position"] == {"1": 0.5, "2": 0.2}
    assert "val_acceptance_length" not in got  # P-EAGLE reports none: none is made up
    got = comparable(FamilyParams(name="dflash"), dflash)
    assert got["val_accuracy_by_position"] == {"1": 0.5, "2": 0.2}  # slot 1 = first drafted
    assert got["val_acceptance_length"] == 1.6


def test_twin_measures_name_what_a_trained_run_names() -> None:
    twin = {"loss": 0.1, "cond_acc_0": 0.5, "cond_acc_1": 0.5, "full_acc_0": 0.5, "full_acc_1": 0.2}
    got = twin_measures(FamilyParams(), twin, "family@e")
    assert got == {
        "val_accuracy_by_position": {"1": 0.5, "2": 0.2},
        "val_acceptance_length": 1.75,  # chained, as MetricsSink derives a trained run's
    }
    dflash = {"loss": 2.0, "position_1_acc": 0.01, "eal": 1.01}
    assert twin_measures(FamilyParams(name="dflash"), dflash, "family@d") == {
        "val_accuracy_by_position": {"1": 0.01},
        "val_acceptance_length": 1.01,
    }


def test_outputs_of_a_branch() -> None:
    out = Outputs.of_family("peagle")
    assert out.stage == "family@peagle" and out.family_key == "families.peagle"
    assert out.trained == paths.FAMILIES_MODELS / "peagle"
    assert out.metrics == paths.FAMILIES_METRICS / "peagle" / "train.json"
    assert Outputs().trained == paths.TRAINED and Outputs().metrics == paths.TRAIN_METRICS


def test_family_branch_params() -> None:
    params = Params.model_validate(
        {
            "train": {"init_from": "models/published", "epochs": 3},
            "families": {
                "p": {"name": "peagle", "num_depths": 3},
                "e": {"name": "eagle3"},
            },
        }
    )
    branch, out = family_branch(params, "p")
    assert branch.train.family.name == "peagle" and branch.train.init_from is None
    assert branch.train.epochs == 3 and out.stage == "family@p"
    assert params.train.family == FamilyParams()  # the params themselves are left as they were
    assert family_branch(params, "e")[0].train.init_from == "models/published"
    with pytest.raises(ParamsError, match=r"no entry 'x' \(entries: p, e\): add it"):
        family_branch(params, "x")


def test_a_branch_reads_its_own_layers_of_the_store() -> None:
    """layers.family_aux_layer_ids.NAME: the branch's aux ids (the store holds the union);
    without an entry a branch reads train's."""
    params = Params.model_validate(
        {
            "layers": {"aux_layer_ids": [2, 4, 5], "family_aux_layer_ids": {"d": [1, 3, 7]}},
            "families": {"d": {"name": "dflash"}, "p": {"name": "peagle"}},
        }
    )
    assert family_branch(params, "d")[0].layers.aux_layer_ids == [1, 3, 7]
    assert family_branch(params, "p")[0].layers.aux_layer_ids == [2, 4, 5]
    with pytest.raises(ValueError, match=r"layers.family_aux_layer_ids.x: no `families` entry"):
        Params.model_validate({"layers": {"family_aux_layer_ids": {"x": [1]}}})


def test_branch_names_are_path_segments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="a dot would nest the params key"):
        Params.model_validate({"families": {"eagle3.1": {"name": "eagle3"}}})


def test_family_eval_refuses_more_drafts_than_trained() -> None:
    from eagle3_pipeline.stages.evaluate import run_family

    params = Params.model_validate(
        {
            "evaluate": {"num_speculative_tokens": 4},
            "families": {"d": {"name": "dflash", "block_size": 4}},
        }
    )
    with pytest.raises(ParamsError, match=r"4 drafts, but families\.d \(dflash\) was trained"):
        run_family(params, "d")
    swept = params.model_copy(deep=True)
    swept.evaluate.num_speculative_tokens, swept.evaluate.num_speculative_tokens_sweep = 3, [1, 5]
    with pytest.raises(ParamsError, match=r"'evaluate\.num_speculative_tokens_sweep': 5 drafts"):
        run_family(swept, "d")
    with pytest.raises(ParamsError, match="no entry 'x'"):
        run_family(params, "x")
