"""extract captures the union of every drafter's layers (layers.family_aux_layer_ids): one store
whose train layers are the bytes a store of train's layers alone holds."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml
from extract_workdir import load_params, make_workdir
from safetensors.torch import load_file

from eagle3_pipeline.stages import extract
from eagle3_pipeline.store import format as store

DFLASH = [1, 3, 5, 7]


def _extract(root: Path, monkeypatch: pytest.MonkeyPatch) -> dict:
    monkeypatch.chdir(root)
    params = load_params(root)
    params.extract.disk_headroom_gb = 0.0
    extract.run(params)
    return store.read_manifest(Path("data/hidden_states"))


def test_one_store_holds_every_familys_layers(
    tiny_verifier_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real verifier (transformers backend): train's layers of the union store equal, byte
    for byte, the store of train's layers alone; DFlash's are there too."""
    alone, union = tmp_path / "alone", tmp_path / "union"
    make_workdir(alone, tiny_verifier_dir, 6, 400)
    shutil.copytree(alone, union, symlinks=True)
    raw = yaml.safe_load((union / "params.yaml").read_text())
    raw["layers"]["family_aux_layer_ids"] = {"dflash": DFLASH}
    raw["families"] = {"dflash": {"name": "dflash"}}
    (union / "params.yaml").write_text(yaml.safe_dump(raw))

    a = _extract(alone, monkeypatch)
    b = _extract(union, monkeypatch)
    assert a["aux_layer_ids"] == [2, 4, 5]
    assert b["aux_layer_ids"] == [1, 2, 3, 4, 5, 7] and b["layer_ids"][-1] == 8
    train_at = store.check_layout(b, [2, 4, 5], 8, union)
    dflash_at = store.check_layout(b, DFLASH, 8, union)
    assert (train_at, dflash_at) == ([1, 3, 4, 6], [0, 2, 4, 5, 6])
    for sid, entry in a["samples"].items():
        narrow = load_file(alone / "data/hidden_states" / entry["file"])["hidden_states"]
        wide = store.read_sample(union / "data/hidden_states", b["samples"][sid])
        assert wide["hidden_states"].shape[1] == 7
        assert narrow.equal(wide["hidden_states"][:, train_at])
        cut = store.read_sample(union / "data/hidden_states", b["samples"][sid], layers=train_at)
        assert narrow.equal(cut["hidden_states"])
