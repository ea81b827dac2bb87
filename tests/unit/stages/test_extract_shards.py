"""`eagle3 extract --shard i/n`: disjoint shards that merge into the store of one unsharded run."""

from __future__ import annotations

import contextlib
import re
from pathlib import Path

import pytest
from extract_workdir import load_params, make_workdir, store_hashes

from eagle3_pipeline.core import resume
from eagle3_pipeline.stages import extract

N, BUDGET = 24, 300


def _no_backend(*_args, **_kwargs):
    raise AssertionError("the merge had nothing left to extract but started the model")


def test_two_shards_merge_into_the_unsharded_store(
    tiny_verifier_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    for name in ("one", "sharded"):
        make_workdir(tmp_path / name, tiny_verifier_dir, N, BUDGET)
    monkeypatch.chdir(tmp_path / "one")
    extract.run(load_params(tmp_path / "one"))
    single = store_hashes(tmp_path / "one")

    monkeypatch.chdir(tmp_path / "sharded")
    params = load_params(tmp_path / "sharded")
    capsys.readouterr()
    for i in range(2):
        extract.run(params, shard=(i, 2))
    log = capsys.readouterr().out
    assert "shard 0/2" in log and "shard 1/2" in log and re.search(r"padding \d+\.\d%", log)
    assert not Path("data/hidden_states").exists()  # shards never publish
    scratch = Path("data/.work/extract")
    ids = [
        {e["id"] for e in resume.Journal(scratch / extract.journal_name((i, 2))).read()}
        for i in range(2)
    ]
    assert ids[0] and ids[1] and not ids[0] & ids[1] and len(ids[0] | ids[1]) == N

    monkeypatch.setattr(extract, "open_backend", _no_backend)
    extract.run(params)  # the merge: reuses both shards' files, extracts nothing
    assert store_hashes(tmp_path / "sharded") == single
    assert not list(scratch.glob("entries*.jsonl"))


def test_merge_extracts_what_missing_shards_left(
    tiny_verifier_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    prompts = make_workdir(tmp_path, tiny_verifier_dir, N, BUDGET)
    monkeypatch.chdir(tmp_path)
    params = load_params(tmp_path)
    calls: list[int] = []
    real = extract.open_backend

    @contextlib.contextmanager
    def counting(*args, **kwargs):
        with real(*args, **kwargs) as run_batch:
            yield lambda batch: (calls.append(len(batch)), run_batch(batch))[1]

    monkeypatch.setattr(extract, "open_backend", counting)
    extract.run(params, shard=(1, 3))
    done = len(calls)
    capsys.readouterr()
    extract.run(params)
    batches = extract.token_budget_batches({s: len(p) for s, p in prompts.items()}, BUDGET)
    assert done == len(batches[1::3]) and len(calls) == len(batches)  # each batch once
    assert f"{N - sum(len(b) for b in batches[1::3])} samples to extract" in capsys.readouterr().out
    assert store_hashes(tmp_path)[0]
