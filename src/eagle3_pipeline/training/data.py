"""The training-data directory speculators' `--data-path` reads, written and checked here.

Row i of an arrow dataset pairs with `hidden_states/hs_<i>.safetensors`. Each file holds
`hidden_states [seq, n, hidden]`: the aux layers in the order of `target_layer_ids` (aux ids
only), then the final layer LAST; speculators feeds `[:, :-1]` to the drafter and makes the
targets from `[:, -1]`. The train/val split is ordered: rows [0, int(n * train_data_ratio))
train, the rest validate, so validation rows go last (`train_data_ratio_for`). A
`sample_id` column names each row's sample: what a run trained on is read from the rows its
loader held (`trained_rows`), not derived again from params.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Literal, TypedDict

from eagle3_pipeline.core.atomic import replace_dir


class TrainingSample(TypedDict):
    """One training row; `hidden_states_file` already exists (we link it, never copy it), or is
    None in online mode: speculators then asks the vLLM server for that row's hidden states."""

    input_ids: list[int]
    loss_mask: list[int]
    hidden_states_file: Path | None


TRAINED_ROWS = "trained_rows.json"  # in save_dir: the training rows each rank's loader held


def write_training_data(
    data_dir: Path,
    samples: list[TrainingSample],
    *,
    ids: list[str] | None = None,
    link: Literal["symlink", "hardlink"] = "symlink",
) -> None:
    """Lay out the directory speculators' `--data-path` reads, replacing `data_dir` whole.

    Row i of the arrow dataset (input_ids, loss_mask, seq_len; torch format) pairs with
    `hidden_states/hs_<i>.safetensors`, a relative symlink (or hardlink) to the sample's file.
    Each file is checked here because speculators silently drops a row whose `token_ids`
    differ from its `input_ids`, and fails with a shape error deep in the model otherwise.
    `ids`: each row's sample id, as the `sample_id` column (speculators reads past it).
    """
    from datasets import Dataset

    if not samples:
        raise ValueError("write_training_data: no samples")
    if ids is not None and len(ids) != len(samples):
        raise ValueError(f"write_training_data: {len(ids)} ids for {len(samples)} samples")
    layer_shape: tuple[int, ...] | None = None
    for i, sample in enumerate(samples):
        if sample["hidden_states_file"] is None:
            continue
        shape = _check_hidden_states_file(i, sample)
        if layer_shape is None:
            layer_shape = shape
        elif shape != layer_shape:
            raise ValueError(
                f"sample {i}: {sample['hidden_states_file']} has [n_layers, hidden] = "
                f"{list(shape)}, sample 0 has {list(layer_shape)}: all files must come from "
                "one extraction"
            )

    with replace_dir(data_dir) as tmp:
        dataset = Dataset.from_dict(
            {
                "input_ids": [s["input_ids"] for s in samples],
                "loss_mask": [s["loss_mask"] for s in samples],
                "seq_len": [len(s["input_ids"]) for s in samples],
            }
            | ({"sample_id": list(ids)} if ids is not None else {})
        )
        # speculators compares stored token_ids with these rows as torch tensors.
        dataset.set_format(type="torch")
        dataset.save_to_disk(str(tmp))
        hs_dir = tmp / "hidden_states"
        hs_dir.mkdir()
        for i, sample in enumerate(samples):
            if sample["hidden_states_file"] is None:
                continue
            source = Path(sample["hidden_states_file"]).absolute()
            target = hs_dir / f"hs_{i}.safetensors"
            if link == "symlink":
                # tmp is a sibling of data_dir, so the relative path survives the rename.
                target.symlink_to(os.path.relpath(source, hs_dir))
            else:
                os.link(source, target)


def train_data_ratio_for(n_train: int, n_rows: int) -> float:
    """The `train_data_ratio` that makes speculators train on exactly the first n_train rows.

    speculators truncates int(n_rows * ratio); n_train / n_rows can land just below n_train.
    """
    if not 0 < n_train < n_rows:
        raise ValueError(f"need 0 < n_train < n_rows, got {n_train} of {n_rows}")
    return (n_train + 0.5) / n_rows


def ids_hash(ids: list[str]) -> str:
    """sha256 of the sorted sample ids, one a line: the same rows give the same hash."""
    return hashlib.sha256("".join(f"{i}\n" for i in sorted(ids)).encode()).hexdigest()


def loaded_rows(dataset: object) -> dict[str, object] | None:
    """{rows, ids_hash} of the sample ids a speculators dataset holds (its `data`, after its
    train/val cut), or None where the data carries no `sample_id` column."""
    data = getattr(dataset, "data", None)
    if data is None or "sample_id" not in data.column_names:
        return None
    ids = [str(i) for i in data.with_format(None)["sample_id"]]
    return {"rows": len(ids), "ids_hash": ids_hash(ids)}


def trained_rows(save_dir: Path, world_size: int) -> dict[str, object]:
    """{train_rows, train_ids_hash}: what the run's `world_size` ranks trained on, from the
    TRAINED_ROWS record rank 0 wrote (every rank's loader holds the whole training split; its
    sampler picks that rank's batches from it). Raises RuntimeError when a rank is missing or
    the ranks held different rows."""
    path = save_dir / TRAINED_ROWS
    if not path.is_file():
        raise RuntimeError(f"{path}: the training recorded no rows it loaded")
    ranks = json.loads(path.read_text())["ranks"]
    if sorted(r["rank"] for r in ranks) != list(range(world_size)):
        raise RuntimeError(
            f"{path}: rows recorded by ranks {sorted(r['rank'] for r in ranks)}, "
            f"expected ranks 0..{world_size - 1}"
        )
    held = {(r["rows"], r["ids_hash"]) for r in ranks}
    if len(held) != 1:
        raise RuntimeError(f"{path}: the ranks loaded different training rows: {ranks}")
    rows, digest = held.pop()
    return {"train_rows": rows, "train_ids_hash": digest}


def check_layer_count(
    data_dir: Path, target_layer_ids: list[int], positions: list[int] | None = None
) -> None:
    """Fail early when files and ids disagree (speculators fails later with a matmul error).

    `positions`: where the run's layers sit in files that hold more (the final one last)."""
    from safetensors import safe_open

    path: Path | None = data_dir / "hidden_states" / "hs_0.safetensors"
    if not path.exists():  # online mode leaves train rows to the server: any stored row
        path = next((data_dir / "hidden_states").glob("hs_*.safetensors"), None)
    if path is None:
        return  # online mode with nothing stored: the server's files are checked as they come
    with safe_open(str(path), framework="pt") as f:
        n_layers = f.get_slice("hidden_states").get_shape()[1]
    if positions is not None:
        if len(positions) != len(target_layer_ids) + 1 or n_layers != positions[-1] + 1:
            raise ValueError(
                f"{path} holds {n_layers} layers; the run reads positions {positions} for aux "
                f"ids {target_layer_ids} + final: rerun extract"
            )
    elif n_layers != len(target_layer_ids) + 1:
        raise ValueError(
            f"{path} holds {n_layers} layers but target_layer_ids {target_layer_ids} name "
            f"{len(target_layer_ids)} aux layers: pass the aux ids only (the files hold them "
            "plus the final layer, last)"
        )


def _check_hidden_states_file(index: int, sample: TrainingSample) -> tuple[int, ...]:
    """Return the file's [n_layers, hidden]; raise ValueError naming what does not match."""
    from safetensors import safe_open

    path = Path(sample["hidden_states_file"])
    seq = len(sample["input_ids"])
    if len(sample["loss_mask"]) != seq:
        raise ValueError(
            f"sample {index}: {len(sample['loss_mask'])} loss_mask values for {seq} input_ids"
        )
    if not path.is_file():
        raise ValueError(f"sample {index}: hidden-state file {path} does not exist")
    with safe_open(str(path), framework="pt") as f:
        keys = set(f.keys())
        if not {"hidden_states", "token_ids"} <= keys:
            raise ValueError(
                f"sample {index}: {path} holds {sorted(keys)}; speculators needs "
                "'hidden_states' and 'token_ids'"
            )
        shape = tuple(f.get_slice("hidden_states").get_shape())
        token_ids = f.get_tensor("token_ids").tolist()
    if len(shape) != 3 or shape[0] != seq:
        raise ValueError(
            f"sample {index}: {path} hidden_states has shape {list(shape)}, expected "
            f"[{seq}, n_layers, hidden]"
        )
    if token_ids != list(sample["input_ids"]):
        raise ValueError(f"sample {index}: token_ids in {path} differ from the row's input_ids")
    return shape[1:]
