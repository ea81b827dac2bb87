"""extract grows by rows: samples added, changed and removed after a run are the only ones
extracted, the others' files come from the last published store (in the workspace or only in
the DVC cache, without the scratch folder), and the store equals one built from scratch."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import dvc_outputs
import pytest
from extract_workdir import fake_backend, load_params, make_workdir, store_hashes

from eagle3_pipeline.stages import extract
from eagle3_pipeline.store import format as store

N, BUDGET = 20, 400


def _grow(root: Path) -> None:
    """data/tokenized/ grown: train-0005 removed, train-0003 changed, two samples added, and
    train-0001 moved to val (its file is the same; its split is prepare's)."""
    rows = {}
    for split in ("train", "val"):
        for line in (root / f"data/tokenized/{split}.jsonl").read_text().splitlines():
            r = json.loads(line)
            rows[r["id"]] = r
    del rows["train-0005"]
    rows["train-0003"]["input_ids"] = rows["train-0003"]["input_ids"][:-1] + [7]
    rows["train-0001"]["split"] = "val"
    for k, n in ((90, 12), (91, 33)):
        sid = f"train-{k:04d}"
        rows[sid] = {
            "id": sid,
            "split": "train",
            "input_ids": list(range(10, 10 + n)),
            "loss_mask": [0, 0] + [1] * (n - 2),
        }
    for split in ("train", "val"):
        (root / f"data/tokenized/{split}.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in rows.values() if r["split"] == split)
        )


def _extracted(calls: list[list[list[int]]]) -> list[list[int]]:
    return [ids for batch in calls for ids in batch]


def _recording_backend(calls: list[list[list[int]]]):
    """The stand-in model of extract_workdir, recording every sample it computes."""
    counts: list[int] = []
    inner = fake_backend(counts)

    def open_backend(*args, **kwargs):
        compute = inner(*args, **kwargs).__enter__()

        def run_batch(batch):
            calls.append(batch)
            return compute(batch)

        return __import__("contextlib").nullcontext(run_batch)

    return open_backend


@pytest.mark.parametrize("teammate", ["workspace", "dvc-cache"])
def test_only_new_and_changed_samples_are_extracted(
    tiny_verifier_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys, teammate
) -> None:
    run, scratch = tmp_path / "run", tmp_path / "scratch"
    make_workdir(run, tiny_verifier_dir, N, BUDGET)
    make_workdir(scratch, tiny_verifier_dir, N, BUDGET)
    calls: list[list[list[int]]] = []
    monkeypatch.setattr(extract, "open_backend", _recording_backend(calls))
    monkeypatch.chdir(run)
    extract.run(load_params(run))
    assert len(_extracted(calls)) == N
    if teammate == "dvc-cache":  # pulled: in the cache and dvc.lock, deleted by `dvc repro`
        dvc_outputs.commit(run, "extract", ["data/hidden_states"], "hardlink,symlink")
        dvc_outputs.pulled_only(run, ["data/hidden_states"])
    else:  # the published store alone: no scratch folder
        shutil.rmtree(run / "data/.work")

    _grow(run)
    calls.clear()
    capsys.readouterr()
    extract.run(load_params(run))
    grown = {json.loads(x)["id"]: json.loads(x) for x in _lines(run)}
    made = _extracted(calls)  # (a) only the new and the changed samples
    assert sorted(made) == sorted(
        grown[s]["input_ids"] for s in ("train-0003", "train-0090", "train-0091")
    )
    log = capsys.readouterr().out
    where = "data/hidden_states" + (" as dvc.lock records it" if teammate == "dvc-cache" else "")
    assert f"[extract] reused 18 of 21 rows from {where}" in log and "; making 3" in log
    manifest = store.read_manifest(run / "data/hidden_states")
    assert "train-0005" not in manifest["samples"]  # (b) the removed sample is gone
    assert not (run / "data/hidden_states/train-0005.safetensors").exists()
    assert manifest["samples"]["train-0001"]["split"] == "val"
    if teammate == "dvc-cache":  # kept files are the cache's objects, linked, not copied
        kept = run / "data/hidden_states/train-0002.safetensors"
        assert os.stat(kept).st_nlink >= 2

    _grow(scratch)
    monkeypatch.chdir(scratch)
    extract.run(load_params(scratch))
    assert store_hashes(run) == store_hashes(scratch)  # (c) manifest and every file's bytes


def _lines(root: Path) -> list[str]:
    return [
        line
        for split in ("train", "val")
        for line in (root / f"data/tokenized/{split}.jsonl").read_text().splitlines()
    ]


def test_a_sample_whose_settings_changed_is_extracted_again(
    tiny_verifier_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another store dtype: no file of the last store is reused (a key is the settings too)."""
    make_workdir(tmp_path, tiny_verifier_dir, 6, BUDGET)
    calls: list[list[list[int]]] = []
    monkeypatch.setattr(extract, "open_backend", _recording_backend(calls))
    monkeypatch.chdir(tmp_path)
    params = load_params(tmp_path)
    extract.run(params)
    calls.clear()
    params.extract.store_dtype = "fp8"
    extract.run(params)
    assert len(_extracted(calls)) == 6
    calls.clear()
    params.extract.max_tokens_per_batch = 2 * BUDGET  # how samples are batched, not what they are
    extract.run(params)
    assert calls == []
