"""Any id a dataset carries reaches the store: derived file names, the id kept in the manifest."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from extract_workdir import fake_backend, load_params, make_workdir

from eagle3_pipeline.stages import extract
from eagle3_pipeline.store import format as store
from eagle3_pipeline.store import verify as store_verify
from eagle3_pipeline.verifier.identity import read_verifier

ODD = ["sharegpt/12345", "urn:uuid:4f1c2a9e:8b1d", "prompt-é日本", "..", ".hidden", "ABC", "abc"]


def test_odd_ids_go_through_extract_and_store_verify(
    tiny_verifier_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    make_workdir(tmp_path, tiny_verifier_dir, 20, 200)
    monkeypatch.chdir(tmp_path)
    renamed: dict[str, str] = {}
    for split in ("train", "val"):
        path = Path(f"data/tokenized/{split}.jsonl")
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        for r in rows:
            if len(renamed) < len(ODD) and split == "train":
                renamed[r["id"]] = r["id"] = ODD[len(renamed)] + (
                    "x" * 300 if len(renamed) == 0 else ""
                )
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    params = load_params(tmp_path)
    params.extract.disk_headroom_gb = 0.0
    monkeypatch.setattr(extract, "open_backend", fake_backend([]))
    extract.run(params)
    out = Path("data/hidden_states")
    manifest = store.read_manifest(out)
    assert set(renamed.values()) <= set(manifest["samples"])  # original ids in the manifest
    files = [e["file"] for e in manifest["samples"].values()]
    assert len(set(f.casefold() for f in files)) == 20
    assert not [f for f in files if f.startswith(".") or "/" in f or len(f) > 200]
    assert sorted(p.name for p in out.iterdir()) == sorted([*files, store.MANIFEST])
    assert store_verify.main(read_verifier(params.verifier), params.layers, store_dir=str(out)) == 0
