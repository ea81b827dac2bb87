"""Each drafter family trained by speculators' own trainer on the tiny run inputs: the flags it
gets, its checkpoint, and the hidden-state noise reaching its own forward."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from train_workspace import tiny_settings, train_tiny

from eagle3_pipeline.config.families import FamilyParams
from eagle3_pipeline.training.run import build_train_config

MASK = 500  # an id no row of the tiny inputs holds (checked below)


def _config(inputs: dict[str, Any], tmp_path: Path, **family: Any) -> dict[str, Any]:
    settings = tiny_settings(
        inputs, tmp_path, family=FamilyParams(**family), mask_token_id=family.get("mask_token_id")
    )
    return build_train_config(settings).flatten()


def test_train_config_per_family(inputs: dict[str, Any], tmp_path: Path) -> None:
    eagle3 = _config(inputs, tmp_path)
    assert (eagle3["speculator_type"], eagle3["mask_token_id"]) == ("eagle3", 0)
    assert (eagle3["draft_arch"], eagle3["num_layers"], eagle3["norm_before_fc"]) == (
        "llama",
        1,
        True,
    )
    peagle = _config(inputs, tmp_path, name="peagle", num_depths=4, mask_token_id=500)
    assert (peagle["speculator_type"], peagle["num_depths"], peagle["mask_token_id"]) == (
        "peagle",
        4,
        500,
    )
    assert peagle["norm_before_fc"] is True  # P-EAGLE keeps EAGLE-3's wiring
    dflash = _config(inputs, tmp_path, name="dflash", block_size=4, mask_token_id=500)
    # DFlash: speculators' recipe (Qwen3-style, 5 layers), none of EAGLE-3's wiring flags.
    assert (dflash["draft_arch"], dflash["num_layers"], dflash["block_size"]) == ("qwen3", 5, 4)
    assert dflash["norm_before_fc"] is False and dflash["norm_output"] is False


@pytest.mark.slow
@pytest.mark.parametrize(
    ("family", "model_type"),
    [
        (FamilyParams(name="peagle", num_depths=3, mask_token_id=MASK), "peagle"),
        (FamilyParams(name="dflash", block_size=4, num_layers=1, mask_token_id=MASK), "dflash"),
    ],
)
def test_family_trains_and_saves_its_type(
    inputs: dict[str, Any], tmp_path: Path, family: FamilyParams, model_type: str
) -> None:
    """Two epochs on CPU: a checkpoint of the family's own type, its mask token and knobs in
    the saved config, and a train loss that went down."""
    import json

    assert all(MASK not in s["input_ids"] for s in inputs["samples"])
    logged = train_tiny(inputs, tmp_path, family=family, mask_token_id=MASK, epochs=2)
    config = json.loads((tmp_path / "ckpt" / "1" / "config.json").read_text())
    assert config["speculators_model_type"] == model_type
    assert config["mask_token_id"] == MASK
    losses = [m["train"]["loss"] for _, m in logged if "train" in m]
    half = len(losses) // 2
    assert sum(losses[half:]) / (len(losses) - half) < sum(losses[:half]) / half


@pytest.mark.slow
def test_eagle3_1_trains_its_norms(inputs: dict[str, Any], tmp_path: Path) -> None:
    """With the wiring an eagle3.1 branch resolves to, speculators trains an eagle3 drafter with
    one norm per aux layer and none over their concatenation, and writes the flags vLLM reads."""
    import json

    family = FamilyParams(name="eagle3.1")
    logged = train_tiny(inputs, tmp_path, family=family, epochs=2, **family.wiring())
    config = json.loads((tmp_path / "ckpt" / "1" / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3"
    assert (config["fc_norm"], config["norm_before_fc"], config["norm_output"]) == (
        True,
        False,
        True,
    )
    weights = load_file(tmp_path / "ckpt" / "1" / "model.safetensors")
    norms = [
        weights[f"fc_norm.{i}.weight"]
        for i in range(len(config["eagle_aux_hidden_state_layer_ids"]))
    ]
    assert not any(k.startswith("input_norm.") for k in weights)
    assert any(not torch.equal(n, torch.ones_like(n)) for n in norms)  # trained, not left at init
    losses = [m["train"]["loss"] for _, m in logged if "train" in m]
    half = len(losses) // 2
    assert sum(losses[half:]) / (len(losses) - half) < sum(losses[:half]) / half


@pytest.mark.slow
def test_noise_reaches_peagle_forward(inputs: dict[str, Any], tmp_path: Path) -> None:
    """P-EAGLE overrides EAGLE-3's forward: noise must change its training all the same (a
    patch of EAGLE-3's forward alone would leave these weights equal), and be undone after."""
    from speculators.models.peagle.core import PEagleDraftModel

    original = PEagleDraftModel.forward
    family = FamilyParams(name="peagle", num_depths=3, mask_token_id=MASK)

    def weights(name: str, noise: float) -> dict[str, torch.Tensor]:
        run = tmp_path / name
        run.mkdir()
        train_tiny(inputs, run, family=family, mask_token_id=MASK, noise_std=noise)
        return load_file(run / "ckpt" / "0" / "model.safetensors")

    clean, noisy = weights("clean", 0.0), weights("noisy", 0.5)
    assert not torch.equal(clean["fc.weight"], noisy["fc.weight"])
    assert PEagleDraftModel.forward is original


@pytest.mark.slow
def test_untrained_twin_is_measured_by_speculators_own_validation(
    inputs: dict[str, Any], tmp_path: Path
) -> None:
    """The twin's val record has the trained run's keys; nothing of it is left behind, and the
    training hooks (noise, resume) are not involved: two measures are equal."""
    from eagle3_pipeline.training.data import write_training_data
    from eagle3_pipeline.training.run import untrained_val

    family = FamilyParams(name="dflash", block_size=4, num_layers=1, mask_token_id=MASK)
    settings = tiny_settings(inputs, tmp_path, family=family, mask_token_id=MASK)
    write_training_data(settings.data_dir, inputs["samples"])
    first = untrained_val(settings, tmp_path / "twin")
    assert {"loss", "eal", "position_1_acc", "position_3_acc"} <= set(first)
    assert not (tmp_path / "twin").exists() and not (tmp_path / "ckpt").exists()
    assert untrained_val(settings, tmp_path / "twin") == first
