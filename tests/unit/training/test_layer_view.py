"""The store view a drafter reads its own layers through (training.layer_view): speculators'
trainer, given a store that holds more layers, trains exactly as on files of its layers only."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from train_workspace import AUX_IDS, tiny_settings, train_tiny

from eagle3_pipeline.config.families import FamilyParams
from eagle3_pipeline.training import layer_view
from eagle3_pipeline.training.data import check_layer_count, write_training_data
from eagle3_pipeline.training.run import build_train_config

# The wide store: two other families' layers around train's (aux 2, 4, 5 at positions 1, 3, 4).
WIDE_AUX = [1, 2, 3, 4, 5, 7]
POSITIONS = [1, 3, 4, 6]


def _widen(inputs: dict[str, Any], root: Path) -> list[dict[str, Any]]:
    """The samples' files with extra random layers between theirs (the final one stays last)."""
    root.mkdir()
    gen = torch.Generator().manual_seed(1)
    wide = []
    for i, s in enumerate(inputs["samples"]):
        raw = load_file(s["hidden_states_file"])
        hs = raw["hidden_states"]
        out = torch.randn(hs.shape[0], len(WIDE_AUX) + 1, hs.shape[2], generator=gen)
        out = out.to(hs.dtype)
        out[:, POSITIONS] = hs
        path = root / f"wide{i}.safetensors"
        save_file({"hidden_states": out, "token_ids": raw["token_ids"]}, path)
        wide.append(s | {"hidden_states_file": path})
    return wide


def test_flags_name_the_view_only_when_the_files_hold_more() -> None:
    assert layer_view.flags(None) == {} and layer_view.flags([0, 1, 2, 3]) == {}
    assert layer_view.flags([1, 3, 4, 6]) == {
        "hidden_states_backend": "layer_view",
        "layer_view_positions": "1,3,4,6",
    }
    assert layer_view.flags([1, 0, 2])["layer_view_positions"] == "1,0,2"  # another order


def test_speculators_builds_the_view_from_the_train_config(
    inputs: dict[str, Any], tmp_path: Path
) -> None:
    """Through speculators' own backend lookup (cli.py: registry[name].from_train_args): the
    transfer cuts each row to the run's layers, in the run's order, final last."""
    from hs_connectors import HiddenStatesBackend

    wide = _widen(inputs, tmp_path / "wide")
    settings = tiny_settings(inputs, tmp_path, store_positions=POSITIONS)
    write_training_data(settings.data_dir, wide)
    check_layer_count(settings.data_dir, AUX_IDS, POSITIONS)
    with pytest.raises(ValueError, match="holds 7 layers"):
        check_layer_count(settings.data_dir, AUX_IDS)  # without the view: 7 layers, not 4
    flat = build_train_config(settings).flatten()
    assert flat["hidden_states_backend"] == "layer_view"
    args = argparse.Namespace(**flat)
    transfer = HiddenStatesBackend.registry[flat["hidden_states_backend"]].from_train_args(
        args, flat["data_path"]
    )
    row = transfer.get_cached(0)
    narrow = load_file(inputs["samples"][0]["hidden_states_file"])["hidden_states"]
    assert torch.equal(row["hidden_states"], narrow)
    # A run of every layer in order keeps speculators' own fp8 backend (train's default).
    plain = build_train_config(tiny_settings(inputs, tmp_path / "p", store_positions=[0, 1, 2, 3]))
    assert plain.flatten()["hidden_states_backend"] == "fp8"


def test_a_view_past_the_files_layers_is_refused(inputs: dict[str, Any], tmp_path: Path) -> None:
    from hs_connectors.transfer import FP8Transfer

    write_training_data(tmp_path / "data", inputs["samples"][:1])
    view = layer_view.LayerViewTransfer(FP8Transfer(tmp_path / "data" / "hidden_states"), [0, 9])
    with pytest.raises(ValueError, match=r"holds 4 layers, the view reads positions \[0, 9\]"):
        view.get_cached(0)


@pytest.mark.slow
def test_training_through_the_view_equals_training_on_its_own_layers(
    inputs: dict[str, Any], tmp_path: Path
) -> None:
    """Same seed, same rows: the drafter trained from the wide store through the view has the
    weights of the one trained from files that hold its layers only (a wrong position, or the
    extra layers reaching it, would change them)."""
    narrow = tmp_path / "narrow"
    train_tiny(inputs, narrow)
    wide_run = tmp_path / "wide-run"
    settings = tiny_settings(inputs, wide_run, store_positions=POSITIONS)
    write_training_data(settings.data_dir, _widen(inputs, tmp_path / "wide"))
    train_tiny(inputs, wide_run, store_positions=POSITIONS)
    a = load_file(narrow / "ckpt" / "0" / "model.safetensors")
    b = load_file(wide_run / "ckpt" / "0" / "model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.mark.slow
def test_dflash_reads_its_own_subset(inputs: dict[str, Any], tmp_path: Path) -> None:
    """DFlash with two of the store's layers: it trains, and its saved config names them (the
    ids vLLM captures when serving it)."""
    import json

    run = tmp_path / "run"
    family = FamilyParams(name="dflash", block_size=4, num_layers=1, mask_token_id=500)
    own = [1, 4]  # positions 0 and 3 of the wide store
    settings = tiny_settings(inputs, run, store_positions=[0, 3, 6])
    write_training_data(settings.data_dir, _widen(inputs, tmp_path / "wide"))
    train_tiny(
        inputs,
        run,
        family=family,
        mask_token_id=500,
        target_layer_ids=own,
        store_positions=[0, 3, 6],
    )
    config = json.loads((run / "ckpt" / "0" / "config.json").read_text())
    assert config["aux_hidden_state_layer_ids"] == own
