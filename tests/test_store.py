"""Hidden-state store: atomic files in speculators' layout, manifest, layout checks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eagle3_pipeline import store
from eagle3_pipeline.errors import StoreError
from eagle3_pipeline.resume import file_sha256

LAYOUT = store.StoreLayout([2, 4, 5], 8, 16, "bf16", {"name_or_path": "v"})


def test_round_trip_and_manifest(tmp_path: Path) -> None:
    hs = torch.randn(11, 4, 16)
    entry = store.write_sample(tmp_path, "s1", hs, torch.arange(11), torch.ones(11), LAYOUT)
    assert entry == {
        "file": "s1.safetensors",
        "num_tokens": 11,
        "sha256": file_sha256(tmp_path / "s1.safetensors"),
    }
    raw = load_file(str(tmp_path / "s1.safetensors"))  # what speculators reads
    assert raw["hidden_states"].dtype == torch.bfloat16 and raw["hidden_states"].shape == (
        11,
        4,
        16,
    )
    assert raw["token_ids"].dtype == torch.int64
    torch.testing.assert_close(raw["hidden_states"].float(), hs, atol=0.05, rtol=0.01)
    store.write_manifest(tmp_path, LAYOUT, {"s1": entry | {"split": "train"}})
    m = store.read_manifest(tmp_path)
    assert m["layer_ids"] == [2, 4, 5, 8] and m["num_tokens"] == 11
    assert not list(tmp_path.glob(".*tmp"))  # no temp files left behind
    store.check_layout(m, [2, 4, 5], 8, tmp_path)
    with pytest.raises(StoreError, match="rerun extract"):
        store.check_layout(m, [1, 4, 5], 8, tmp_path)


def test_rejects_wrong_shapes_and_ids(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="does not match the store layout"):
        store.write_sample(
            tmp_path, "s", torch.randn(3, 3, 16), torch.arange(3), torch.ones(3), LAYOUT
        )
    with pytest.raises(StoreError, match="unsafe"):
        store.write_sample(
            tmp_path, "../x", torch.randn(3, 4, 16), torch.arange(3), torch.ones(3), LAYOUT
        )
    with pytest.raises(StoreError, match="no manifest"):
        store.read_manifest(tmp_path)


def test_damaged_file_is_reported(tmp_path: Path) -> None:
    entry = store.write_sample(
        tmp_path, "s", torch.randn(3, 4, 16), torch.arange(3), torch.ones(3), LAYOUT
    )
    p = tmp_path / entry["file"]
    p.write_bytes(p.read_bytes()[:40])
    with pytest.raises(StoreError, match="unreadable"):
        store.read_sample(tmp_path, entry)
