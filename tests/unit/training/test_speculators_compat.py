"""speculators_compat against the real speculators 0.9.0 trainer, on a tiny random verifier."""

from __future__ import annotations

import importlib.metadata
import json
import math
import os
import signal
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from eagle3_pipeline.training import speculators_compat as sc

AUX_IDS = [2, 4, 5]  # + final layer 8: 4 layers per file
HIDDEN = 64
VOCAB = 512
DRAFT_VOCAB = 128
N_ROWS = 24
N_TRAIN = 18


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A tiny verifier, 24 samples with random hidden states, and a d2t/t2d pair."""
    root = tmp_path_factory.mktemp("inputs")
    torch.manual_seed(0)
    config = LlamaConfig(
        num_hidden_layers=8,
        hidden_size=HIDDEN,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=VOCAB,
        max_position_embeddings=512,
    )
    LlamaForCausalLM(config).save_pretrained(root / "verifier")

    gen = torch.Generator().manual_seed(0)
    samples: list[sc.TrainingSample] = []
    freq: dict[int, int] = {}
    (root / "store").mkdir()
    for i in range(N_ROWS):
        seq = int(torch.randint(32, 65, (1,), generator=gen))
        ids = torch.randint(0, VOCAB, (seq,), generator=gen)
        path = root / "store" / f"sample{i}.safetensors"
        hidden = torch.randn(seq, len(AUX_IDS) + 1, HIDDEN, generator=gen)
        save_file({"hidden_states": hidden.to(torch.bfloat16), "token_ids": ids}, path)
        mask = [0] * (seq // 4) + [1] * (seq - seq // 4)
        for token, supervised in zip(ids.tolist(), mask, strict=True):
            freq[token] = freq.get(token, 0) + supervised
        samples.append({"input_ids": ids.tolist(), "loss_mask": mask, "hidden_states_file": path})

    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    d2t, t2d = build_vocab_mappings_from_distribution(freq, DRAFT_VOCAB, VOCAB)
    np.save(root / "d2t.npy", d2t.numpy())
    np.save(root / "t2d.npy", t2d.numpy())
    return {"root": root, "samples": samples}


def _train(inputs: dict[str, Any], tmp_path: Path, **overrides: Any) -> list[tuple[int, dict]]:
    data_dir = tmp_path / "data"
    if not data_dir.exists():
        sc.write_training_data(data_dir, inputs["samples"])
    metrics: list[tuple[int, dict]] = []
    kwargs: dict[str, Any] = {
        "data_dir": data_dir,
        "verifier_dir": inputs["root"] / "verifier",
        "save_dir": tmp_path / "ckpt",
        "d2t_path": inputs["root"] / "d2t.npy",
        "t2d_path": inputs["root"] / "t2d.npy",
        "draft_vocab_size": DRAFT_VOCAB,
        "target_layer_ids": AUX_IDS,
        "epochs": 1,
        "lr": 3e-3,
        "scheduler": "cosine",
        "warmup_ratio": 0.1,
        "noise_std": 0.0,
        "ttt_steps": 3,
        "ttt_step_loss_decay": 1.0,
        "total_seq_len": 256,
        "seed": 0,
        "num_workers": 0,
        "train_data_ratio": sc.train_data_ratio_for(N_TRAIN, N_ROWS),
        "on_metrics": lambda m, step: metrics.append((step, m)),
    }
    sc.run_training(**(kwargs | overrides))
    return metrics


def test_check_version_accepts_pinned() -> None:
    sc.check_version()


def test_check_version_rejects_other(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.10.0")
    with pytest.raises(RuntimeError, match=r"speculators 0\.10\.0 .* 0\.9\.0"):
        sc.check_version()
    with pytest.raises(RuntimeError):
        sc.apply_cpu_shims()


def test_train_data_ratio_for_is_exact() -> None:
    for n_rows in range(2, 400):
        for n_train in range(1, n_rows):
            assert int(n_rows * sc.train_data_ratio_for(n_train, n_rows)) == n_train


def test_written_data_reads_back_through_speculators(
    inputs: dict[str, Any], tmp_path: Path
) -> None:
    from hs_connectors.transfer import FP8Transfer
    from speculators.train.data import ArrowDataset

    samples = inputs["samples"]
    sc.write_training_data(tmp_path / "data", samples)
    link = tmp_path / "data" / "hidden_states" / f"hs_{N_ROWS - 1}.safetensors"
    assert link.is_symlink() and not os.path.isabs(os.readlink(link))
    assert link.resolve() == samples[-1]["hidden_states_file"].resolve()

    val = ArrowDataset(
        max_len=256,
        datapath=tmp_path / "data",
        transfer=FP8Transfer(tmp_path / "data" / "hidden_states"),  # run_training's backend
        train_ratio=sc.train_data_ratio_for(N_TRAIN, N_ROWS),
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
    sample: sc.TrainingSample = {
        "input_ids": list(range(40)),
        "loss_mask": [1] * 40,
        "hidden_states_file": path,
    }
    sc.write_training_data(tmp_path / "data", [sample, sample])
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
    sc.write_training_data(tmp_path / "data", samples, link="hardlink")
    linked = tmp_path / "data" / "hidden_states" / "hs_2.safetensors"
    assert not linked.is_symlink()
    assert linked.stat().st_ino == samples[2]["hidden_states_file"].stat().st_ino


def test_write_training_data_rejects_token_mismatch(inputs: dict[str, Any], tmp_path: Path) -> None:
    bad = dict(inputs["samples"][1])
    bad["input_ids"] = [(t + 1) % VOCAB for t in bad["input_ids"]]
    with pytest.raises(ValueError, match="sample 1: token_ids"):
        sc.write_training_data(tmp_path / "data", [inputs["samples"][0], bad])
    assert not (tmp_path / "data").exists()


def test_run_training_rejects_final_id_and_noise(inputs: dict[str, Any], tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="aux ids only"):
        _train(inputs, tmp_path, target_layer_ids=[*AUX_IDS, 8])
    with pytest.raises(ValueError, match="noise"):
        _train(inputs, tmp_path, noise_std=-0.1)
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.slow
def test_train_resume_and_best_checkpoint(inputs: dict[str, Any], tmp_path: Path) -> None:
    first = _train(inputs, tmp_path, epochs=1)
    second = _train(inputs, tmp_path, epochs=2)  # resumes after epoch 0
    save_dir = tmp_path / "ckpt"

    for epoch in (0, 1):
        for name in ("config.json", "model.safetensors", "optimizer_state_dict.pt"):
            assert (save_dir / str(epoch) / name).is_file()
    assert sc.best_checkpoint(save_dir) in {save_dir / "0", save_dir / "1"}

    train = [(step, m["train"]) for step, m in first + second if "train" in m]
    assert [step for step, _ in train] == list(range(len(train)))
    assert {m["epoch"] for _, m in second} == {1}  # epoch 0 was not rerun
    for _, values in train:
        assert math.isfinite(values["loss"])
        assert {f"full_acc_{k}" for k in range(3)} <= values.keys()
    vals = [m["val"] for _, m in first + second if "val" in m]
    assert len(vals) == 2 and all(math.isfinite(v["loss_epoch"]) for v in vals)

    config = json.loads((save_dir / "1" / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == AUX_IDS
    assert config["norm_before_fc"] is True and config["norm_output"] is True
    assert config["draft_vocab_size"] == DRAFT_VOCAB
    assert config["transformer_layer_config"]["num_hidden_layers"] == 1
    verifier = config["speculators_config"]["verifier"]["name_or_path"]
    assert verifier == str(inputs["root"] / "verifier")

    # speculators keeps the draft lm_head frozen at the verifier's rows.
    weights = load_file(save_dir / "1" / "model.safetensors")
    assert torch.equal(weights["lm_head.weight"], _verifier_head_rows(inputs))


@pytest.mark.slow
def test_train_lm_head(inputs: dict[str, Any], tmp_path: Path) -> None:
    from speculators.models.eagle3.core import Eagle3DraftModel

    original = Eagle3DraftModel.load_verifier_weights
    _train(inputs, tmp_path, train_lm_head=True)
    weights = load_file(tmp_path / "ckpt" / "0" / "model.safetensors")
    assert not torch.equal(weights["lm_head.weight"], _verifier_head_rows(inputs))
    assert Eagle3DraftModel.load_verifier_weights is original


@pytest.mark.slow
def test_signal_raises_training_interrupted(inputs: dict[str, Any], tmp_path: Path) -> None:
    def interrupt(metrics: dict, step: int) -> None:
        os.kill(os.getpid(), signal.SIGINT)  # speculators' handler catches it (as SIGTERM)

    with pytest.raises(sc.TrainingInterrupted):
        _train(inputs, tmp_path, on_metrics=interrupt)
    assert (tmp_path / "ckpt" / "interrupted" / "model.safetensors").is_file()
    assert not (tmp_path / "ckpt" / "0").exists()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def _verifier_head_rows(inputs: dict[str, Any]) -> torch.Tensor:
    verifier = load_file(inputs["root"] / "verifier" / "model.safetensors")
    t2d = torch.from_numpy(np.load(inputs["root"] / "t2d.npy"))
    return verifier["lm_head.weight"][t2d].to(torch.bfloat16)


@pytest.mark.slow
def test_noise_changes_training_and_stays_reproducible(
    inputs: dict[str, Any], tmp_path: Path
) -> None:
    def weights(name: str, noise: float) -> dict[str, torch.Tensor]:
        run = tmp_path / name
        run.mkdir()
        _train(inputs, run, noise_std=noise)
        return load_file(run / "ckpt" / "0" / "model.safetensors")

    clean, noisy, noisy_again = weights("a", 0.0), weights("b", 0.5), weights("c", 0.5)
    assert not torch.equal(clean["fc.weight"], noisy["fc.weight"])
    assert all(torch.equal(noisy[k], noisy_again[k]) for k in noisy)
    from speculators.models.eagle3.core import Eagle3DraftModel

    assert Eagle3DraftModel.forward.__name__ == "forward"  # the patch was undone


def _fake_epoch(save_dir: Path, epoch: int, *, complete: bool, val_loss: float | None) -> None:
    d = save_dir / str(epoch)
    d.mkdir(parents=True)
    (d / "model.safetensors").write_bytes(b"x")
    if val_loss is not None:
        (d / "val_metrics.json").write_text(json.dumps({"loss_epoch": val_loss}))
    (save_dir / f"epoch{epoch}_end").symlink_to(str(epoch))
    if complete:
        (d / sc.COMPLETE_MARKER).write_text("{}")


def test_discard_incomplete_keeps_only_marked_epochs(tmp_path: Path) -> None:
    save = tmp_path / "ckpt"
    _fake_epoch(save, 0, complete=True, val_loss=0.5)
    _fake_epoch(save, 1, complete=True, val_loss=0.4)
    _fake_epoch(save, 2, complete=False, val_loss=0.3)  # killed before its marker
    (save / "interrupted").mkdir()
    (save / "checkpoint_best").symlink_to("2")
    removed = sc.discard_incomplete(save)
    assert set(removed) == {"2", "interrupted", "epoch2_end", "checkpoint_best"}
    assert sc.complete_epochs(save) == [0, 1]
    assert sorted(p.name for p in save.iterdir()) == [
        "0",
        "1",
        "checkpoint_best",
        "epoch0_end",
        "epoch1_end",
    ]
    assert sc.best_checkpoint(save) == save / "1"  # re-pointed to the best complete epoch
    assert sc.discard_incomplete(save) == []


def test_prune_keeps_last_and_best(tmp_path: Path) -> None:
    save = tmp_path / "ckpt"
    for epoch, loss in enumerate([0.5, 0.2, 0.4, 0.3, 0.35]):
        _fake_epoch(save, epoch, complete=epoch < 4, val_loss=loss)
    (save / "checkpoint_best").symlink_to("1")
    sc._prune(save, keep_last=2)
    assert sc.complete_epochs(save) == [1, 2, 3]  # best (1) + the newest two complete
    assert (save / "4").is_dir()  # incomplete: not the pruner's business
    assert not (save / "epoch0_end").is_symlink()
    sc._prune(save, keep_last=1)
    assert sc.complete_epochs(save) == [1, 3]


def test_torchrun_command() -> None:
    cmd = sc.torchrun_command(2, "eagle3_pipeline.stages.train", ["--worker", "p.json"])
    assert cmd[1:] == [
        "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
        "-m", "eagle3_pipeline.stages.train", "--worker", "p.json",
    ]  # fmt: skip


def test_run_training_rejects_bad_knobs(inputs: dict[str, Any], tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="grad_accumulation"):
        _train(inputs, tmp_path, grad_accumulation=0)
    with pytest.raises(ValueError, match="keep_last"):
        _train(inputs, tmp_path, keep_last=0)
    with pytest.raises(ValueError, match="torchrun"):
        _train(inputs, tmp_path, fsdp=True)


@pytest.mark.slow
def test_grad_accumulation_steps_every_nth_batch(inputs: dict[str, Any], tmp_path: Path) -> None:
    """N=3: one optimizer and scheduler step per 3 micro-batches (and the epoch's last one)."""
    counts = {}
    for n in (1, 3):
        run = tmp_path / f"acc{n}"
        run.mkdir()
        metrics = _train(inputs, run, grad_accumulation=n, total_seq_len=128)
        train = [m for _, m in metrics if "train" in m]
        stepped = [i for i, m in enumerate(train) if "grad_norm" in m]
        assert all(math.isfinite(train[i]["grad_norm"]) for i in stepped)
        assert stepped == [i for i in range(len(train)) if (i + 1) % n == 0 or i + 1 == len(train)]
        optimizer = torch.load(run / "ckpt" / "0" / "optimizer_state_dict.pt")
        scheduler = torch.load(run / "ckpt" / "0" / "scheduler_state_dict.pt")
        steps = {int(s["step"]) for s in optimizer["state"].values()}
        counts[n] = (len(train), steps, scheduler["last_epoch"])
        # lr is logged per micro-batch: constant within a group of n
        lrs = [m["lr"] for m in train]
        assert all(lrs[i] == lrs[i - i % n] for i in range(len(lrs)))
    batches = counts[1][0]
    assert batches >= 4 and counts[3][0] == batches
    assert counts[1][1:] == ({batches}, batches)
    groups = math.ceil(batches / 3)
    assert counts[3][1:] == ({groups}, groups)
