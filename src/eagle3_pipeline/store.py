"""Hidden-state store: one safetensors file per sample plus a manifest.

Each file is readable by speculators' loaders as is: `hidden_states [seq, n_layers, hidden]` (aux
layers in order, then the final layer LAST) and `token_ids [seq]` int64, plus our `loss_mask [seq]`
(speculators ignores extra keys). The manifest names the layer ids, their convention, dtype and the
verifier, and lists each file with its token count and sha256. A file without a manifest entry
does not exist: files are written under a temp name and renamed, and the manifest is written last.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from eagle3_pipeline import atomic
from eagle3_pipeline.errors import StoreError
from eagle3_pipeline.resume import file_sha256

MANIFEST = "manifest.json"
FORMAT_VERSION = 1
LAYER_CONVENTION = (
    "vllm: id k < N is the input of decoder layer k; id N is the last decoder layer's output "
    "before the final norm"
)
_SAFE_ID = re.compile(r"^[A-Za-z0-9._-]+$")


@dataclass(frozen=True)
class StoreLayout:
    """What every file of one store shares."""

    aux_layer_ids: list[int]
    final_layer_id: int
    hidden_size: int
    dtype: str  # "bf16"
    verifier: dict[str, Any]

    @property
    def layer_ids(self) -> list[int]:
        return [*self.aux_layer_ids, self.final_layer_id]

    def bytes_per_token(self) -> int:
        return len(self.layer_ids) * self.hidden_size * 2


def sample_filename(sample_id: str) -> str:
    if not _SAFE_ID.match(sample_id):
        raise StoreError(f"sample id {sample_id!r} has characters unsafe in a file name")
    return f"{sample_id}.safetensors"


def write_sample(
    root: Path,
    sample_id: str,
    hidden_states: torch.Tensor,
    token_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    layout: StoreLayout,
) -> dict[str, Any]:
    """Write one sample atomically; return its manifest entry."""
    seq, n_layers, hidden = hidden_states.shape
    if n_layers != len(layout.layer_ids) or hidden != layout.hidden_size:
        raise StoreError(
            f"sample {sample_id}: hidden_states shape {tuple(hidden_states.shape)} does not match "
            f"the store layout ({len(layout.layer_ids)} layers x {layout.hidden_size})"
        )
    if token_ids.shape != (seq,) or loss_mask.shape != (seq,):
        raise StoreError(f"sample {sample_id}: token_ids/loss_mask length differs from {seq}")
    tensors = {
        "hidden_states": hidden_states.to(torch.bfloat16).contiguous(),
        "token_ids": token_ids.to(torch.int64).contiguous(),
        "loss_mask": loss_mask.to(torch.int64).contiguous(),
    }
    name = sample_filename(sample_id)
    path = atomic.atomic_write(root / name, lambda p: save_file(tensors, str(p)))
    return {"file": name, "num_tokens": seq, "sha256": file_sha256(path)}


def read_sample(root: Path, entry: dict[str, Any]) -> dict[str, torch.Tensor]:
    path = root / entry["file"]
    try:
        return load_file(str(path))
    except Exception as exc:  # safetensors raises several types for damaged files
        raise StoreError(
            f"{path}: unreadable ({exc}): run `eagle3 extract` to rewrite it"
        ) from None


def write_manifest(root: Path, layout: StoreLayout, entries: dict[str, dict[str, Any]]) -> None:
    manifest = {
        "format_version": FORMAT_VERSION,
        "layer_convention": LAYER_CONVENTION,
        "aux_layer_ids": layout.aux_layer_ids,
        "final_layer_id": layout.final_layer_id,
        "layer_ids": layout.layer_ids,
        "hidden_size": layout.hidden_size,
        "dtype": layout.dtype,
        "verifier": layout.verifier,
        "num_samples": len(entries),
        "num_tokens": sum(e["num_tokens"] for e in entries.values()),
        "samples": dict(sorted(entries.items())),
    }
    atomic.write_json(root / MANIFEST, manifest)


def read_manifest(root: Path) -> dict[str, Any]:
    path = root / MANIFEST
    if not path.is_file():
        raise StoreError(f"{path}: no manifest: run the extract stage (`dvc repro extract`)")
    manifest = json.loads(path.read_text())
    if manifest.get("format_version") != FORMAT_VERSION:
        raise StoreError(f"{path}: format_version {manifest.get('format_version')} unsupported")
    return manifest


def check_layout(manifest: dict[str, Any], aux: list[int], final: int, where: Path) -> None:
    """Refuse a store whose layer ids differ from the run's: a drafter would learn wrong inputs."""
    if manifest["aux_layer_ids"] != aux or manifest["final_layer_id"] != final:
        raise StoreError(
            f"{where}/{MANIFEST}: store has layer ids {manifest['aux_layer_ids']} + "
            f"{manifest['final_layer_id']} but params ask for {aux} + {final}: rerun extract"
        )
