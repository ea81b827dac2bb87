"""`eagle3 store verify`: every kind of bad file is named, a good store passes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from builders import fake_verifier, make_params, params_file, pretrained

from eagle3_pipeline.cli import main as cli_main
from eagle3_pipeline.config.params import Params
from eagle3_pipeline.core.errors import StoreError
from eagle3_pipeline.store import format as store
from eagle3_pipeline.store import verify as store_verify
from eagle3_pipeline.verifier.identity import read_verifier

AUX, FINAL, HIDDEN = [2, 4, 5], 8, 16


@pytest.fixture(params=["bf16", "fp8"])
def workdir(request, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A repo-like dir: verifier config, tokenized rows and the store extracted from them."""
    monkeypatch.chdir(tmp_path)
    config = {"num_hidden_layers": FINAL, "hidden_size": HIDDEN, "vocab_size": 300}
    fake_verifier(tmp_path / "data/verifier", config)
    layout = store.StoreLayout(AUX, FINAL, HIDDEN, request.param, {"name_or_path": "v"})
    g = torch.Generator().manual_seed(0)
    (tmp_path / "data/tokenized").mkdir()
    entries = {}
    for split, names in {"train": ["a", "b", "c"], "val": ["d"]}.items():
        rows = []
        for sid in names:
            n = int(torch.randint(4, 20, (1,), generator=g))
            ids = torch.randint(0, 300, (n,), generator=g)
            mask = torch.ones(n, dtype=torch.long)
            rows.append(
                {"id": sid, "input_ids": ids.tolist(), "loss_mask": mask.tolist(), "split": split}
            )
            hs = torch.randn(n, 4, HIDDEN, generator=g)
            entry = store.write_sample(Path("data/hidden_states"), sid, hs, ids, mask, layout)
            entries[sid] = entry | {"split": split}
        path = tmp_path / "data/tokenized" / f"{split}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    store.write_manifest(Path("data/hidden_states"), layout, entries)
    params_file(
        tmp_path / "params.yaml",
        verifier=pretrained("data/verifier"),
        layers={"aux_layer_ids": AUX, "final_layer_id": FINAL},
        extract={"store_dtype": request.param},
    )
    return tmp_path


def _verify(params: Params, store_dir: str) -> int:
    return store_verify.main(read_verifier(params.verifier), params.layers, store_dir=store_dir)


def test_good_store_passes(workdir: Path, capsys) -> None:
    assert cli_main(["store", "verify"]) == 0
    assert "OK: data/hidden_states: 4 files" in capsys.readouterr().out


def test_bad_files_are_listed_with_reasons(workdir: Path, capsys) -> None:
    root = Path("data/hidden_states")
    a = root / "a.safetensors"
    a.write_bytes(a.read_bytes()[:-10])  # truncated
    b = root / "b.safetensors"
    data = bytearray(b.read_bytes())
    data[-3] ^= 0x40  # one flipped bit in the values
    b.write_bytes(bytes(data))
    (root / "stray.safetensors").write_bytes(b"x")
    (root / "d.safetensors").unlink()
    rows = [json.loads(x) for x in Path("data/tokenized/train.jsonl").read_text().splitlines()]
    rows[2]["input_ids"][0] = (rows[2]["input_ids"][0] + 1) % 300  # c: store from other inputs
    Path("data/tokenized/train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    assert _verify(make_params(Path("params.yaml")), str(root)) == 1
    out = capsys.readouterr().out
    bad = {
        line.split(":")[0].removeprefix("BAD "): line
        for line in out.splitlines()
        if line.startswith("BAD ")
    }
    assert set(bad) == {str(root / f"{n}.safetensors") for n in ("a", "b", "c", "d", "stray")}
    assert "truncated" in bad[str(root / "a.safetensors")]
    assert "sha256 differs" in bad[str(root / "b.safetensors")]
    assert "token_ids differ from the tokenized input_ids" in bad[str(root / "c.safetensors")]
    assert "file missing" in bad[str(root / "d.safetensors")]
    assert "not in the manifest" in bad[str(root / "stray.safetensors")]
    assert "5 bad (4 files in the manifest)" in out


def test_hardlinked_damage_names_the_dvc_fix(workdir: Path, capsys) -> None:
    """A damaged file that shares its inode with DVC's cache needs a chmod before dvc repro."""
    root = Path("data/hidden_states")
    cache = workdir / "cache"
    cache.mkdir()
    (cache / "obj").hardlink_to(root / "a.safetensors")  # what DVC's hardlink cache does
    data = bytearray((root / "a.safetensors").read_bytes())
    data[-1] ^= 1
    with open(root / "a.safetensors", "r+b") as fh:  # in place: the cache object changes too
        fh.write(bytes(data))
    with pytest.raises(StoreError, match="1 file"):
        store.verify_hashes(root, store.read_manifest(root))
    assert _verify(make_params(Path("params.yaml")), str(root)) == 1
    out = capsys.readouterr().out
    assert f"chmod u+w {root / 'a.safetensors'} && dvc repro extract" in out


def test_layer_ids_other_than_params_are_reported(workdir: Path, capsys) -> None:
    params = make_params(Path("params.yaml")).model_copy(deep=True)
    params.layers.aux_layer_ids = [1, 4, 5]
    assert _verify(params, "data/hidden_states") == 1
    assert (
        "manifest.json: layer ids [2, 4, 5, 8], params ask for [1, 4, 5, 8]"
        in capsys.readouterr().out
    )
