"""The training-data directory, read back through speculators' own dataset."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from train_workspace import AUX_IDS, HIDDEN, N_ROWS, N_TRAIN, VOCAB

from eagle3_pipeline.training import data


def test_train_data_ratio_for_is_exact() -> None:
    for n_rows in range(2, 400):
        for n_train in range(1, n_rows):
            assert int(n_rows * data.train_data_ratio_for(n_train, n_rows)) == n_train


def test_written_data_reads_back_through_speculators(
    inputs: dict[str, Any], tmp_path: Path
) -> None:
    from hs_connectors.transfer import FP8Transfer
    from speculators.train.data import ArrowDataset

    samples = inputs["samples"]
    data.write_training_data(tmp_path / "data", samples)
    link = tmp_path / "data" / "hidden_states" / f"hs_{N_ROWS - 1}.safetensors"
    assert link.is_symlink() and not os.path.isabs(os.readlink(link))
    assert link.resolve() == samples[-1]["hidden_states_file"].resolve()

    val = ArrowDataset(
        max_len=256,
        datapath=tmp_path / "data",
        transfer=FP8Transfer(tmp_path / "data" / "hidden_states"),  # run_training's backend
        train_ratio=data.train_data_ratio_for(N_TRAIN, N_ROWS),
        split="val",
        on_missing="raise",
    )
    assert len(val) == N_ROWS - N_TRAIN
    row = val[N_ROWS - N_TRAIN - 1]  # the last row: hs_23
    stored = load_file(samples[-1]["hidden_states_file"])["hidden_states"]
    assert row["hidden_states"].shape == (stored.shape[0], len(AUX_IDS) * HIDDEN)
    assert torch.equal(row["verifier_last_hidden_states"], stored[:, -1])
    assert row["loss_mask"].tolist() == samples[-1]["loss_mask"]


def test_fp8_files_are_dequantized(tmp_path: Path) -> None:
    """A store may keep fp8 with a scale per token and layer; the backend we pick reads it."""
    from hs_connectors.transfer import FP8Transfer
    from speculators.train.data import ArrowDataset

    hidden = torch.randn(40, len(AUX_IDS) + 1, HIDDEN)
    scale = hidden.abs().amax(dim=2, keepdim=True) / torch.finfo(torch.float8_e4m3fn).max
    path = tmp_path / "fp8.safetensors"
    fp8 = (hidden / scale).to(torch.float8_e4m3fn)
    save_file(
        {"hidden_states": fp8, "hidden_states_scales": scale, "token_ids": torch.arange(40)}, path
    )
    sample: data.TrainingSample = {
        "input_ids": list(range(40)),
        "loss_mask": [1] * 40,
        "hidden_states_file": path,
    }
    data.write_training_data(tmp_path / "data", [sample, sample])
    rows = ArrowDataset(
        max_len=256,
        datapath=tmp_path / "data",
        transfer=FP8Transfer(tmp_path / "data" / "hidden_states"),
        train_ratio=0.5,
        on_missing="raise",
    )
    row = rows[0]
    assert row["verifier_last_hidden_states"].dtype == torch.bfloat16
    assert torch.allclose(
        row["verifier_last_hidden_states"].float(), hidden[:, -1], rtol=0.1, atol=0.05
    )


def test_write_training_data_hardlinks(inputs: dict[str, Any], tmp_path: Path) -> None:
    samples = inputs["samples"][:3]
    data.write_training_data(tmp_path / "data", samples, link="hardlink")
    linked = tmp_path / "data" / "hidden_states" / "hs_2.safetensors"
    assert not linked.is_symlink()
    assert linked.stat().st_ino == samples[2]["hidden_states_file"].stat().st_ino


def test_write_training_data_rejects_token_mismatch(inputs: dict[str, Any], tmp_path: Path) -> None:
    bad = dict(inputs["samples"][1])
    bad["input_ids"] = [(t + 1) % VOCAB for t in bad["input_ids"]]
    with pytest.raises(ValueError, match="sample 1: token_ids"):
        data.write_training_data(tmp_path / "data", [inputs["samples"][0], bad])
    assert not (tmp_path / "data").exists()


def test_check_layer_count_wants_aux_ids_only(inputs: dict[str, Any], tmp_path: Path) -> None:
    data.write_training_data(tmp_path / "data", inputs["samples"][:2])
    data.check_layer_count(tmp_path / "data", AUX_IDS)
    with pytest.raises(ValueError, match="aux ids only"):
        data.check_layer_count(tmp_path / "data", [*AUX_IDS, 8])


def test_the_rows_speculators_loads_are_named_by_their_sample_ids(
    inputs: dict[str, Any], tmp_path: Path
) -> None:
    """The `sample_id` column reaches speculators' dataset: its train cut names the rows."""
    from speculators.train.data import ArrowDataset

    ids = [f"r{i}" for i in range(N_ROWS)]
    data.write_training_data(tmp_path / "data", inputs["samples"], ids=ids)
    train = ArrowDataset(
        max_len=256,
        datapath=tmp_path / "data",
        train_ratio=data.train_data_ratio_for(N_TRAIN, N_ROWS),
        split="train",
        on_missing="raise",
    )
    assert train[0]["input_ids"].tolist() == inputs["samples"][0]["input_ids"]  # read past it
    assert data.loaded_rows(train) == {"rows": N_TRAIN, "ids_hash": data.ids_hash(ids[:N_TRAIN])}
    assert data.ids_hash(ids[:N_TRAIN]) == data.ids_hash(ids[:N_TRAIN][::-1])  # a set's hash


def test_trained_rows_wants_every_rank_holding_the_same_rows(tmp_path: Path) -> None:
    def record(*ranks: tuple[int, str]) -> None:
        rows = [{"rank": r, "rows": 3, "ids_hash": h} for r, h in ranks]
        (tmp_path / data.TRAINED_ROWS).write_text(json.dumps({"ranks": rows}))

    record((1, "ab"), (0, "ab"))
    assert data.trained_rows(tmp_path, 2) == {"train_rows": 3, "train_ids_hash": "ab"}
    with pytest.raises(RuntimeError, match=r"ranks \[0, 1\], expected ranks 0..2"):
        data.trained_rows(tmp_path, 3)
    record((0, "ab"), (1, "cd"))
    with pytest.raises(RuntimeError, match="different training rows"):
        data.trained_rows(tmp_path, 2)
    (tmp_path / data.TRAINED_ROWS).unlink()
    with pytest.raises(RuntimeError, match="recorded no rows"):
        data.trained_rows(tmp_path, 1)
