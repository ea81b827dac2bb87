"""Sample ids -> store file names: any id works; safe ids keep their name; names stay safe."""

from __future__ import annotations

import os
import unicodedata
from pathlib import Path

import pytest

from eagle3_pipeline.core.errors import DataError
from eagle3_pipeline.store import format as store
from eagle3_pipeline.store.names import check_unique, sample_filename

REAL_IDS = [  # what datasets carry
    "sharegpt/12345",
    "urn:uuid:4f1c2a9e-8b1d-4c1e-9a3b-2f6d7e8c9a01",
    "prompt-é日本",
    "has space",
    "abc\n",
    "..",
    ".",
    ".hidden",
    "-starts-with-dash",
    "x" * 300,
    "A" * 240,
    "CON",
    "a\x00b",
    "日本" * 100,
]


def test_safe_ids_keep_their_name_so_existing_stores_stay_valid() -> None:
    for sid in ("p0001", "train-0001", "s1", "a.b_c-d", "0" * 128):
        assert sample_filename(sid) == f"{sid}.safetensors"


@pytest.mark.parametrize("sid", REAL_IDS)
def test_every_name_is_a_plain_visible_short_lowercase_file(sid: str) -> None:
    name = sample_filename(sid)
    assert name.endswith(".safetensors") and not name.startswith((".", "-"))
    assert "/" not in name and "\\" not in name
    assert not any(unicodedata.category(c) == "Cc" for c in name)
    assert name == name.lower() and name.isascii()
    # the writer's temp name (`.<name>.<pid>.tmp`, pid up to 7 digits) fits NAME_MAX
    assert len(store.temp_name(Path("/x"), name).name.replace(str(os.getpid()), "9" * 7)) <= 255


def test_ids_differing_only_in_case_get_different_names_everywhere() -> None:
    ids = ["abc", "ABC", "Abc", "aBc", "P0001", "p0001", "sharegpt/A", "sharegpt/a"]
    names = [sample_filename(s).casefold() for s in ids]
    assert len(set(names)) == len(ids)  # also on a case-insensitive filesystem
    check_unique(ids, "x")


def test_a_crafted_collision_is_refused_naming_both_ids() -> None:
    derived = sample_filename("ABC").removesuffix(".safetensors")  # a kept name equal to it
    with pytest.raises(DataError, match=r"'ABC' and '.*' map to the same store file"):
        check_unique(["ABC", derived], "data/tokenized")


def test_odd_ids_are_written_and_read_under_their_derived_names(tmp_path: Path) -> None:
    import torch

    layout = store.StoreLayout([1, 2, 3], 4, 16, "bf16", {"name": "t"})
    for sid in REAL_IDS:
        entry = store.write_sample(
            tmp_path, sid, torch.randn(3, 4, 16), torch.arange(3), torch.ones(3), layout
        )
        assert (tmp_path / entry["file"]).is_file()
        assert store.read_sample(tmp_path, entry)["hidden_states"].shape == (3, 4, 16)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert len(files) == len(REAL_IDS) and not [f for f in files if f.startswith(".")]
