"""Hidden-state store: atomic files in speculators' layout, manifest, fp8 codec, file checks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eagle3_pipeline.core.errors import StoreError
from eagle3_pipeline.core.resume import file_sha256
from eagle3_pipeline.store import format as store

LAYOUT = store.StoreLayout([2, 4, 5], 8, 16, "bf16", {"name_or_path": "v"})


def test_round_trip_and_manifest(tmp_path: Path) -> None:
    hs = torch.randn(11, 4, 16)
    entry = store.write_sample(tmp_path, "s1", hs, torch.arange(11), torch.ones(11), LAYOUT)
    assert entry == {
        "file": "s1.safetensors",
        "num_tokens": 11,
        "bytes": (tmp_path / "s1.safetensors").stat().st_size,
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
    assert store.check_layout(m, [2, 4, 5], 8, tmp_path) == [0, 1, 2, 3]
    # A run that reads some of the store's layers (a family's own ids) gets their positions.
    assert store.check_layout(m, [5, 2], 8, tmp_path) == [2, 0, 3]
    with pytest.raises(StoreError, match=r"not \[1\] of the run's \[1, 4, 5\]: rerun extract"):
        store.check_layout(m, [1, 4, 5], 8, tmp_path)
    with pytest.raises(StoreError, match="rerun extract"):
        store.check_layout(m, [2, 4, 5], 7, tmp_path)


def test_rejects_wrong_shapes_and_ids(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="does not match the store layout"):
        store.write_sample(
            tmp_path, "s", torch.randn(3, 3, 16), torch.arange(3), torch.ones(3), LAYOUT
        )
    entry = store.write_sample(  # an id is data: it names no path, it gets a derived name
        tmp_path, "../x", torch.randn(3, 4, 16), torch.arange(3), torch.ones(3), LAYOUT
    )
    assert "/" not in entry["file"] and (tmp_path / entry["file"]).is_file()
    assert (
        sorted(p.name for p in tmp_path.parent.iterdir() if p.name.endswith("x.safetensors")) == []
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


FP8 = store.StoreLayout([2, 4, 5], 8, 16, "fp8", {"name_or_path": "v"})


def _layered(seq: int = 9, seed: int = 0, ratio: float = 1e5) -> torch.Tensor:
    """[seq, 4, 16] whose last (final) layer is `ratio` x larger than the aux layers."""
    g = torch.Generator().manual_seed(seed)
    hs = torch.randn(seq, 4, 16, generator=g)
    hs[:, -1] *= ratio
    return hs


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Relative error per layer: ||got - ref|| / ||ref|| over tokens and hidden."""
    return (got.float() - ref).norm(dim=(0, 2)) / ref.norm(dim=(0, 2))


def test_fp8_per_token_and_layer_scales(tmp_path: Path) -> None:
    hs = _layered()
    entry = store.write_sample(tmp_path, "s", hs, torch.arange(9), torch.ones(9), FP8)
    raw = load_file(str(tmp_path / entry["file"]))
    assert raw["hidden_states"].dtype == torch.float8_e4m3fn
    assert raw["hidden_states"].shape == (9, 4, 16)
    assert raw[store.SCALES_KEY].dtype == torch.float32
    assert raw[store.SCALES_KEY].shape == (9, 4, 1)
    assert FP8.bytes_per_token() == 4 * 16 + 4 * 4 and LAYOUT.bytes_per_token() == 4 * 16 * 2
    got = store.read_sample(tmp_path, entry, dtype=torch.float32)
    assert set(got) == {"hidden_states", "token_ids", "loss_mask"}  # scales are invisible
    assert (_rel_err(got["hidden_states"], hs) < 0.05).all()  # e4m3: 3 mantissa bits
    # One scale per token (hs_connectors' own quantizer) flushes the small layers to fp8
    # subnormals once the layers differ by more than e4m3's normal range (~2^15; at 1e3 both
    # schemes measure the same ~2.6% error).
    from hs_connectors.fp8_utils import dequantize_fp8_tensor, quantize_tensor_to_fp8

    per_token = dequantize_fp8_tensor(*quantize_tensor_to_fp8(hs), dtype=torch.float32)
    assert (_rel_err(per_token, hs)[:-1] > 0.15).all()


def test_speculators_fp8_reader_reads_our_files(tmp_path: Path) -> None:
    """The trainer's reader (hidden_states_backend fp8) sees the same values as ours."""
    from hs_connectors.transfer import FileTransfer, FP8Transfer

    hs = _layered()
    entry = store.write_sample(tmp_path, "hs_0", hs, torch.arange(9), torch.ones(9), FP8)
    theirs = FP8Transfer(tmp_path).get_cached(0)
    ours = store.read_sample(tmp_path, entry)
    assert set(theirs) == set(ours)
    torch.testing.assert_close(theirs["hidden_states"], ours["hidden_states"], atol=0, rtol=8e-3)
    assert theirs["token_ids"].tolist() == list(range(9))
    # ... and bf16 files pass through its fp8 backend untouched, as speculators_compat relies on.
    entry = store.write_sample(tmp_path, "hs_1", hs, torch.arange(9), torch.ones(9), LAYOUT)
    plain = FileTransfer(tmp_path).get_cached(1)
    assert torch.equal(FP8Transfer(tmp_path).get_cached(1)["hidden_states"], plain["hidden_states"])


def test_files_are_deterministic_and_leave_no_temp_files(tmp_path: Path) -> None:
    hs = _layered()
    args = (torch.arange(9), torch.ones(9))
    for layout in (LAYOUT, FP8):
        a = store.write_samples(
            tmp_path / "a", [("x", hs, *args), ("y", hs[:3], *[t[:3] for t in args])], layout
        )
        b = store.write_samples(tmp_path / "b", [("x", hs.clone(), *args)], layout)
        assert a[0]["sha256"] == b[0]["sha256"] == file_sha256(tmp_path / "b/x.safetensors")
    assert not [p for p in tmp_path.rglob("*") if p.name.endswith(".tmp")]


def test_failed_batch_write_leaves_nothing(tmp_path: Path) -> None:
    good = ("ok", torch.randn(3, 4, 16), torch.arange(3), torch.ones(3))
    bad = ("bad", torch.randn(3, 3, 16), torch.arange(3), torch.ones(3))
    with pytest.raises(StoreError, match="does not match"):
        store.write_samples(tmp_path, [good, bad], LAYOUT)
    assert list(tmp_path.iterdir()) == []  # neither the good file nor a temp file


@pytest.mark.parametrize("layout", [LAYOUT, FP8], ids=["bf16", "fp8"])
def test_check_file_finds_every_kind_of_damage(tmp_path: Path, layout) -> None:
    ids = list(range(100, 109))
    mask = [0, 0] + [1] * 7
    entry = store.write_sample(
        tmp_path, "s", _layered(), torch.tensor(ids), torch.tensor(mask), layout
    )
    data = (tmp_path / "s.safetensors").read_bytes()
    row = {"input_ids": ids, "loss_mask": mask}
    assert store.check_file(data, entry, layout, row) == []
    assert any("truncated" in p for p in store.check_file(data[:-7], entry, layout, row))
    assert any("readable" in p for p in store.check_file(data[:30], entry, layout, row))
    flipped = bytearray(data)
    flipped[-1] ^= 0xFF
    assert store.check_file(bytes(flipped), entry, layout, row) == [
        "sha256 differs from the manifest"
    ]
    other = {"input_ids": [*ids[:-1], 7], "loss_mask": mask}
    assert store.check_file(data, entry, layout, other) == [
        "token_ids differ from the tokenized input_ids"
    ]
    wrong = store.StoreLayout([2, 4], 8, 16, layout.dtype, {})
    assert any("expected [9, 3, 16]" in p for p in store.check_file(data, entry, wrong, row))
    other_dtype = store.StoreLayout([2, 4, 5], 8, 16, "bf16" if layout is FP8 else "fp8", {})
    assert store.check_file(data, entry, other_dtype, row)
