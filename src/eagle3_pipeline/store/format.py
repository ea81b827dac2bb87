"""Hidden-state store: one safetensors file per sample plus a manifest.

Each file is readable by speculators' loaders as is: `hidden_states [seq, n_layers, hidden]` (aux
layers in order, then the final layer LAST) and `token_ids [seq]` int64, plus our `loss_mask [seq]`
(speculators ignores extra keys). The manifest names the layer ids, their convention, dtype and the
verifier, and lists each file with its token count, size and sha256. A file without a manifest
entry does not exist: files are written under a temp name, fsynced and renamed, and the manifest
is written last.

`dtype: fp8` stores `hidden_states` as float8 e4m3 with `hidden_states_scales [seq, n_layers, 1]`
float32: one scale per token AND per layer, because the final layer's magnitude differs from the
aux layers' by orders of magnitude in DeepSeek-family models and one shared per-token scale would
flush the small layers to a few fp8 steps. x ~= fp8 * scale; that is exactly how speculators'
`fp8` hidden-states backend (hs_connectors.FP8Transfer) dequantizes (its scales broadcast), so the
trainer reads these files unchanged; `read_sample` dequantizes them for our own readers.
"""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load, load_file, save

from eagle3_pipeline.config.layer_ids import file_positions
from eagle3_pipeline.core import atomic
from eagle3_pipeline.core.errors import StoreError
from eagle3_pipeline.core.resume import file_sha256
from eagle3_pipeline.store.names import sample_filename
from eagle3_pipeline.store.sizes import hidden_bytes_per_token

MANIFEST = "manifest.json"
FORMAT_VERSION = 1
LAYER_CONVENTION = (
    "vllm: id k < N is the input of decoder layer k; id N is the last decoder layer's output "
    "before the final norm"
)
SCALES_KEY = "hidden_states_scales"  # the key speculators' fp8 backend dequantizes with
FP8_ENCODING = (
    "hidden_states float8_e4m3fn [seq, n_layers, hidden] + hidden_states_scales float32 "
    "[seq, n_layers, 1]; x = hidden_states * hidden_states_scales (scale = amax/448 per token "
    "and layer)"
)
TORCH_DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
ID_BYTES_PER_TOKEN = 16  # token_ids + loss_mask, int64 each
_FP8_MAX = torch.finfo(torch.float8_e4m3fn).max


@dataclass(frozen=True)
class StoreLayout:
    """What every file of one store shares."""

    aux_layer_ids: list[int]
    final_layer_id: int
    hidden_size: int
    dtype: str  # "bf16" | "fp8"
    verifier: dict[str, Any]

    @property
    def layer_ids(self) -> list[int]:
        return [*self.aux_layer_ids, self.final_layer_id]

    def bytes_per_token(self) -> int:
        return hidden_bytes_per_token(len(self.layer_ids), self.hidden_size, self.dtype)

    def file_bytes_per_token(self) -> int:
        """Everything a file holds per token (hidden states, token id, loss mask)."""
        return self.bytes_per_token() + ID_BYTES_PER_TOKEN


def quantize_fp8(hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[seq, n_layers, hidden] -> (fp8 e4m3 values, float32 scales [seq, n_layers, 1]).

    Runs on the tensor's device (a GPU quantizes before the copy to the host), in place where
    it can: on CPU this is the writer's bottleneck for fp8.
    """
    amax = torch.linalg.vector_norm(hidden_states, ord=float("inf"), dim=-1, keepdim=True)
    scales = (amax.float() / _FP8_MAX).clamp_(min=1e-12)
    x = hidden_states.float() if hidden_states.dtype != torch.float32 else hidden_states.clone()
    return x.div_(scales).to(torch.float8_e4m3fn).cpu(), scales.cpu()


def dequantize_fp8(
    values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """fp8 values x their scales, computed in float32, returned as `dtype`."""
    return (values.float() * scales.float()).to(dtype)


def encode_sample(
    sample_id: str,
    hidden_states: torch.Tensor,
    token_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    layout: StoreLayout,
) -> bytes:
    """The file's bytes (deterministic: equal tensors give equal bytes, hence equal hashes)."""
    seq, n_layers, hidden = hidden_states.shape
    if n_layers != len(layout.layer_ids) or hidden != layout.hidden_size:
        raise StoreError(
            f"sample {sample_id}: hidden_states shape {tuple(hidden_states.shape)} does not match "
            f"the store layout ({len(layout.layer_ids)} layers x {layout.hidden_size})"
        )
    if token_ids.shape != (seq,) or loss_mask.shape != (seq,):
        raise StoreError(f"sample {sample_id}: token_ids/loss_mask length differs from {seq}")
    tensors = {
        "token_ids": token_ids.to(torch.int64).cpu().contiguous(),
        "loss_mask": loss_mask.to(torch.int64).cpu().contiguous(),
    }
    if layout.dtype == "fp8":
        values, scales = quantize_fp8(hidden_states)
        tensors |= {"hidden_states": values.contiguous(), SCALES_KEY: scales.contiguous()}
    elif layout.dtype == "bf16":
        tensors["hidden_states"] = hidden_states.to(torch.bfloat16).cpu().contiguous()
    else:
        raise StoreError(f"store dtype {layout.dtype!r} unknown: use bf16 or fp8")
    return save(tensors)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()  # releases the GIL: runs beside the disk write


def _write_unsynced(path: Path, data: bytes) -> None:
    try:
        with open(path, "wb") as fh:
            fh.write(data)
    except OSError as exc:  # a failed write() names no file: say which
        raise OSError(exc.errno, exc.strerror, str(path)) from exc


def write_samples(
    root: Path,
    samples: list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]],
    layout: StoreLayout,
) -> list[dict[str, Any]]:
    """Write (id, hidden_states, token_ids, loss_mask) samples atomically; return their entries.

    Per batch, not per file: every file goes to a temp name, all are fsynced (the disk flushes
    them together), renamed, and the directory is fsynced once. Hashes are computed from the
    bytes in memory on a second thread while the disk writes, never by reading the file back.
    """
    root.mkdir(parents=True, exist_ok=True)
    staged: list[tuple[Path, Path]] = []
    entries: list[dict[str, Any]] = []
    try:
        with ThreadPoolExecutor(max_workers=1) as hasher:
            for sample_id, hs, ids, mask in samples:
                name = sample_filename(sample_id)
                data = encode_sample(sample_id, hs, ids, mask, layout)
                digest = hasher.submit(_sha256, data)
                staged.append((temp_name(root, name), root / name))
                _write_unsynced(staged[-1][0], data)
                entries.append(
                    {"file": name, "num_tokens": int(hs.shape[0]), "bytes": len(data)}
                    | {"sha256": digest.result()}
                )
        for tmp, _ in staged:
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        for tmp, final in staged:
            os.replace(tmp, final)
        atomic.fsync_dir(root)
    except BaseException:
        for tmp, _ in staged:
            tmp.unlink(missing_ok=True)
        raise
    return entries


def write_sample(
    root: Path,
    sample_id: str,
    hidden_states: torch.Tensor,
    token_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    layout: StoreLayout,
) -> dict[str, Any]:
    """Write one sample atomically; return its manifest entry (tests and tools write one)."""
    return write_samples(root, [(sample_id, hidden_states, token_ids, loss_mask)], layout)[0]


def temp_name(root: Path, name: str) -> Path:
    """Where `name` is written before its rename (`.<name>.<pid>.tmp`: ignored by readers)."""
    return root / f".{name}.{os.getpid()}.tmp"


def decode(raw: dict[str, torch.Tensor], dtype: torch.dtype = torch.bfloat16) -> dict:
    """What readers see: fp8 files dequantized (scales dropped), bf16 files as stored."""
    if SCALES_KEY not in raw:
        return raw
    out = dict(raw)
    out["hidden_states"] = dequantize_fp8(raw["hidden_states"], out.pop(SCALES_KEY), dtype)
    return out


def read_sample(
    root: Path,
    entry: dict[str, Any],
    dtype: torch.dtype = torch.bfloat16,
    layers: list[int] | None = None,
) -> dict[str, torch.Tensor]:
    """One sample's tensors; `hidden_states` in `dtype` whatever the store's dtype, cut to
    the positions `layers` of its layer axis when given (check_layout's)."""
    path = root / entry["file"]
    try:
        raw = load_file(str(path))
    except Exception as exc:  # safetensors raises several types for damaged files
        raise StoreError(
            f"{path}: unreadable ({exc}): run `eagle3 store verify`, then `eagle3 extract` to "
            "rewrite it"
        ) from None
    sample = decode(raw, dtype)
    if layers is not None and layers != list(range(sample["hidden_states"].shape[1])):
        sample["hidden_states"] = sample["hidden_states"][:, layers]
    return sample


def check_file(
    data: bytes, entry: dict[str, Any], layout: StoreLayout, row: dict[str, Any] | None
) -> list[str]:
    """Everything wrong with one file's bytes (empty list: good).

    Checks the manifest's hash and size, then the content: keys, dtypes, shapes, finite values,
    and token ids / loss mask against the tokenized row they were extracted from.
    """
    problems = []
    if "bytes" in entry and len(data) != entry["bytes"]:
        problems.append(f"size {len(data)} B, manifest says {entry['bytes']} B (truncated?)")
    if _sha256(data) != entry.get("sha256"):
        problems.append("sha256 differs from the manifest")
    try:
        raw = load(data)
    except Exception as exc:
        return [*problems, f"not a readable safetensors file ({str(exc)[:80]})"]
    want = {"hidden_states", "token_ids", "loss_mask"} | (
        {SCALES_KEY} if layout.dtype == "fp8" else set()
    )
    if set(raw) != want:
        return [*problems, f"holds {sorted(raw)}, expected {sorted(want)}"]
    hs, seq = raw["hidden_states"], entry.get("num_tokens")
    n = len(layout.layer_ids)
    if hs.dtype != TORCH_DTYPES[layout.dtype]:
        problems.append(f"hidden_states dtype {hs.dtype}, store dtype is {layout.dtype}")
    if tuple(hs.shape) != (seq, n, layout.hidden_size):
        problems.append(
            f"hidden_states shape {list(hs.shape)}, expected [{seq}, {n}, {layout.hidden_size}] "
            f"(layer ids {layout.layer_ids})"
        )
    if layout.dtype == "fp8":
        sc = raw[SCALES_KEY]
        if sc.dtype != torch.float32 or tuple(sc.shape) != (seq, n, 1):
            problems.append(
                f"{SCALES_KEY} {sc.dtype} {list(sc.shape)}, expected float32 [{seq}, {n}, 1]"
            )
    if not problems and not torch.isfinite(decode(raw, torch.float32)["hidden_states"]).all():
        problems.append("hidden_states has NaN or inf values")
    for key in ("token_ids", "loss_mask"):
        if raw[key].dtype != torch.int64 or tuple(raw[key].shape) != (seq,):
            problems.append(
                f"{key} {raw[key].dtype} {list(raw[key].shape)}, expected int64 [{seq}]"
            )
    if row is not None and not problems:
        if raw["token_ids"].tolist() != row["input_ids"]:
            problems.append("token_ids differ from the tokenized input_ids")
        if raw["loss_mask"].tolist() != [int(x) for x in row["loss_mask"]]:
            problems.append("loss_mask differs from the tokenized loss_mask")
    return problems


def verify_hashes(root: Path, manifest: dict[str, Any], workers: int | None = None) -> None:
    """Re-hash every file of the store; raise naming the damaged ones.

    For a consumer about to train on the store: with DVC's hardlink cache a damaged workspace
    file is also a damaged cache object that `dvc repro` would check out again unnoticed.
    """
    entries = list(manifest["samples"].values())

    def bad(entry: dict[str, Any]) -> bool:
        path = root / entry["file"]
        return not path.is_file() or file_sha256(path) != entry["sha256"]

    with ThreadPoolExecutor(max_workers=workers or os.cpu_count() or 1) as pool:
        damaged = [e["file"] for e, b in zip(entries, pool.map(bad, entries), strict=True) if b]
    if damaged:
        raise StoreError(
            f"{root}: {len(damaged)} file(s) differ from {MANIFEST} (e.g. {damaged[0]}): run "
            "`eagle3 store verify` for the list and the fix"
        )


def layout_of(manifest: dict[str, Any]) -> StoreLayout:
    return StoreLayout(
        manifest["aux_layer_ids"],
        manifest["final_layer_id"],
        manifest["hidden_size"],
        manifest["dtype"],
        manifest["verifier"],
    )


def write_manifest(root: Path, layout: StoreLayout, entries: dict[str, dict[str, Any]]) -> None:
    manifest = {
        "format_version": FORMAT_VERSION,
        "layer_convention": LAYER_CONVENTION,
        "aux_layer_ids": layout.aux_layer_ids,
        "final_layer_id": layout.final_layer_id,
        "layer_ids": layout.layer_ids,
        "hidden_size": layout.hidden_size,
        "dtype": layout.dtype,
        "bytes_per_token": layout.bytes_per_token(),
        "verifier": layout.verifier,
        "num_samples": len(entries),
        "num_tokens": sum(e["num_tokens"] for e in entries.values()),
        "samples": dict(sorted(entries.items())),
    }
    if layout.dtype == "fp8":
        manifest["encoding"] = FP8_ENCODING
    atomic.write_json(root / MANIFEST, manifest)


def read_manifest(root: Path) -> dict[str, Any]:
    path = root / MANIFEST
    if not path.is_file():
        raise StoreError(f"{path}: no manifest: run the extract stage (`dvc repro extract`)")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise StoreError(f"{path}: not valid JSON ({exc}): rerun `eagle3 extract`") from None
    if manifest.get("format_version") != FORMAT_VERSION:
        raise StoreError(f"{path}: format_version {manifest.get('format_version')} unsupported")
    return manifest


def check_layout(manifest: dict[str, Any], aux: list[int], final: int, where: Path) -> list[int]:
    """Where the run's layers (aux, then final) sit in the store's files; refuse a store that
    lacks any of them: a drafter would learn wrong inputs. A store holds more layers when
    families need others (layers.family_aux_layer_ids); each run reads its own."""
    if manifest["final_layer_id"] != final:
        raise StoreError(
            f"{where}/{MANIFEST}: store has layer ids {manifest['aux_layer_ids']} + "
            f"{manifest['final_layer_id']} but params ask for {aux} + {final}: rerun extract"
        )
    return file_positions(manifest["aux_layer_ids"], final, aux, f"{where}/{MANIFEST}")
