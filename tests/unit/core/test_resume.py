"""Resume state: journals survive a torn last line; scratch folders reset when inputs change."""

from __future__ import annotations

import os
from pathlib import Path

from eagle3_pipeline.core import resume


def test_journal_ignores_and_cuts_torn_line(tmp_path: Path) -> None:
    j = resume.Journal(tmp_path / "j.jsonl")
    j.append([{"id": 1}, {"id": 2}])
    with open(j.path, "ab") as fh:
        fh.write(b'{"id": 3')  # killed mid-write
    assert [r["id"] for r in j.read()] == [1, 2]
    j.append([{"id": 4}])
    assert [r["id"] for r in j.read()] == [1, 2, 4]


def test_scratch_dir_resets_on_new_fingerprint(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    d = resume.scratch_dir("s", resume.fingerprint({"a": 1}))
    (d / "work").write_text("x")
    assert (resume.scratch_dir("s", resume.fingerprint({"a": 1})) / "work").exists()
    assert not (resume.scratch_dir("s", resume.fingerprint({"a": 2})) / "work").exists()
    assert os.path.isdir(tmp_path / "data/.work/s")
