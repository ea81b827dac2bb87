"""harness/published.py: a stage's last published output, from the workspace or, where `dvc
repro` deleted it, from the DVC cache as dvc.lock records it."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import dvc_outputs
import pytest

from eagle3_pipeline.harness import published

OUT = Path("data/generated")


def _output(root: Path, rows: str) -> None:
    """A new file, never one written in place: with a hardlink cache it is the cache's object."""
    (root / OUT).mkdir(parents=True, exist_ok=True)
    (root / OUT / "train.jsonl").unlink(missing_ok=True)
    (root / OUT / "train.jsonl").write_text(rows)


def test_nothing_published_is_none(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert published.previous(OUT) is None
    assert published.keyed_rows(OUT, ("train.jsonl",)) == ({}, None)


def test_the_workspace_output_is_read_first(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    _output(tmp_path, '{"id": "a", "row_key": "k1"}\n{"id": "b"}\n')
    rows, where = published.keyed_rows(OUT, ("train.jsonl", "val.jsonl"))
    assert rows == {"k1": {"id": "a", "row_key": "k1"}} and where == "data/generated"


@pytest.mark.parametrize("cache_type, linked", [("hardlink,symlink", True), (None, False)])
def test_a_deleted_output_is_read_from_the_cache_as_dvc_lock_records_it(
    tmp_path: Path, monkeypatch, cache_type: str | None, linked: bool
) -> None:
    monkeypatch.chdir(tmp_path)
    _output(tmp_path, '{"id": "a", "row_key": "k1"}\n')
    dvc_outputs.commit(tmp_path, "generate", [str(OUT)], cache_type)
    md5 = published.locked_dir_md5(OUT)
    assert md5 and md5.endswith(".dir")
    _output(tmp_path, '{"id": "a", "row_key": "k2"}\n')  # a newer output in the workspace wins
    assert set(published.keyed_rows(OUT, ("train.jsonl",))[0]) == {"k2"}
    dvc_outputs.pulled_only(tmp_path, [str(OUT)])
    prev = published.previous(OUT)
    assert (
        prev is not None
        and prev.where == f"data/generated as dvc.lock records it ({md5[:8]}, DVC cache)"
    )
    assert prev.file("train.jsonl").read_text() == '{"id": "a", "row_key": "k1"}\n'
    assert prev.file("val.jsonl") is None
    assert prev.link is linked  # a copy cache's objects never share an inode with the workspace
    prev.put("train.jsonl", tmp_path / "placed.jsonl")
    assert (os.stat(tmp_path / "placed.jsonl").st_nlink > 1) is linked


def test_a_lock_whose_objects_are_not_in_the_cache_is_nothing(tmp_path: Path, monkeypatch) -> None:
    """dvc.lock committed by a teammate whose outputs were never pulled."""
    monkeypatch.chdir(tmp_path)
    _output(tmp_path, "{}\n")
    dvc_outputs.commit(tmp_path, "generate", [str(OUT)])
    dvc_outputs.pulled_only(tmp_path, [str(OUT)])
    shutil.rmtree(tmp_path / ".dvc/cache")
    assert published.previous(OUT) is None


def test_the_reuse_line() -> None:
    assert published.reuse_line(10, 3, "data/x", 7) == "reused 7 of 10 rows from data/x; making 3"
    assert published.reuse_line(10, 10, None, 0) == (
        "reused 0 of 10 rows from no earlier output; making 10"
    )
    assert published.reuse_line(10, 1, "data/x", 7, 2) == (
        "reused 9 of 10 rows from data/x (7) and the scratch journal (2); making 1"
    )
