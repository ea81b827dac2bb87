"""A temp dir laid out like the repo for the extract stage (params.yaml, data/verifier,
data/tokenized/), the store it publishes re-hashed, and a deterministic stand-in backend."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch
import yaml

from eagle3_pipeline.config.params import Params
from eagle3_pipeline.core import resume
from eagle3_pipeline.store import format as store

AUX, FINAL = [2, 4, 5], 8


def make_workdir(
    root: Path, verifier: Path, n_samples: int, max_tokens: int, dtype: str = "bf16"
) -> dict[str, list[int]]:
    """params.yaml, data/verifier (a link) and data/tokenized/; returns id -> input_ids."""
    root.mkdir(parents=True, exist_ok=True)
    params = {
        "verifier": {"source": "pretrained", "path": "data/verifier"},
        "layers": {"aux_layer_ids": AUX, "final_layer_id": FINAL},
        "extract": {"backend": "hf", "max_tokens_per_batch": max_tokens, "store_dtype": dtype},
    }
    (root / "params.yaml").write_text(yaml.safe_dump(params))
    (root / "data/tokenized").mkdir(parents=True)
    (root / "data/verifier").symlink_to(verifier)
    gen = torch.Generator().manual_seed(1)
    out: dict[str, list[int]] = {}
    rows: dict[str, list[dict]] = {"train": [], "val": []}
    for k in range(n_samples):
        split = "val" if k % 10 == 0 else "train"
        n = int(torch.randint(8, 160, (1,), generator=gen))
        sid = f"{split}-{k:04d}"
        ids = torch.randint(10, 1000, (n,), generator=gen).tolist()
        rows[split].append(
            {"id": sid, "input_ids": ids, "loss_mask": [0, 0] + [1] * (n - 2), "split": split}
        )
        out[sid] = ids
    for split, rs in rows.items():
        (root / "data/tokenized" / f"{split}.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in rs)
        )
    return out


def load_params(root: Path) -> Params:
    return Params.model_validate(yaml.safe_load((root / "params.yaml").read_text()))


def store_hashes(root: Path) -> tuple[bytes, dict[str, str]]:
    """The manifest's bytes and every file's sha256, re-hashed from disk."""
    store_dir = root / "data/hidden_states"
    manifest = store.read_manifest(store_dir)
    hashes = {
        e["file"]: resume.file_sha256(store_dir / e["file"]) for e in manifest["samples"].values()
    }
    for e in manifest["samples"].values():
        assert hashes[e["file"]] == e["sha256"]
    return (store_dir / store.MANIFEST).read_bytes(), hashes


def fake_backend(calls: list[int]):
    """Deterministic stand-in for the model: hidden states derived from the token ids."""

    def run_batch(batch: list[list[int]]) -> list[torch.Tensor]:
        calls.append(len(batch))
        return [
            torch.tensor(ids, dtype=torch.float32)[:, None, None].expand(-1, 4, 64).clone()
            for ids in batch
        ]

    return lambda *_args, **_kwargs: contextlib.nullcontext(run_batch)
