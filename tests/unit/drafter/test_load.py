"""Drafters load with their verifier's local directory, whatever name their config records."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from builders import model_files
from drafter_fixtures import build_drafter, build_llama_verifier
from offline_hub import MESSAGE, UNREACHABLE_HUB_ID, forbid_hub

from eagle3_pipeline.core.errors import CheckpointError
from eagle3_pipeline.drafter import load as drafter

AUX = [2, 4, 7]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A verifier in its own folder and a drafter whose config names it by an unreachable hub id."""
    root = tmp_path_factory.mktemp("own-verifier")
    verifier = build_llama_verifier(root / "models" / "my-verifier")
    model = build_drafter(verifier, list(range(256)), AUX, seed=3)
    out = root / "drafter"
    model.save_pretrained(out)
    config = json.loads((out / "config.json").read_text())
    config["speculators_config"]["verifier"]["name_or_path"] = UNREACHABLE_HUB_ID
    model_files(out, config=config)
    return verifier, out


def test_hub_name_alone_would_reach_the_hub(saved, monkeypatch) -> None:
    """What broke export: speculators resolves the recorded name (the guard below is live)."""
    from speculators.models.eagle3.core import Eagle3DraftModel

    forbid_hub(monkeypatch)
    with pytest.raises(Exception, match=MESSAGE):
        Eagle3DraftModel.from_pretrained(str(saved[1]))


def test_loads_from_the_local_verifier(saved, monkeypatch) -> None:
    verifier, out = saved
    forbid_hub(monkeypatch)
    model = drafter.load_drafter(out, verifier)
    d2t, t2d = model.d2t.clone(), model.t2d.clone()
    fresh = drafter.fresh_drafter_like(out, verifier, d2t, t2d, seed=0)
    from safetensors.torch import load_file

    head = load_file(str(verifier / "model.safetensors"))["lm_head.weight"]
    assert torch.equal(model.verifier_lm_head.weight.float(), head.float()[t2d.bool()])
    assert fresh.config.eagle_aux_hidden_state_layer_ids == AUX
    # The file keeps the name users know; only the in-memory config points at the folder.
    saved_config = json.loads((out / "config.json").read_text())
    assert saved_config["speculators_config"]["verifier"]["name_or_path"] == UNREACHABLE_HUB_ID


def test_missing_local_verifier_is_one_line(saved, tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="verifier.path in params.yaml"):
        drafter.load_drafter(saved[1], tmp_path / "nowhere")
