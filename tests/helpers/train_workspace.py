"""Small inputs for training: a `train` stage workspace, or speculators-level run inputs.

`build_workspace` (synthetic store, tokenized rows, vocab, params) serves the stage tests (resume,
DDP); `build_run_inputs` and `tiny_settings` (a tiny verifier, samples, d2t/t2d) the unit tests
of eagle3_pipeline.training. Hidden states are random but seeded: inputs built alike are
identical bytes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from safetensors.torch import load_file, save_file

AUX_IDS = [2, 4, 5]
FINAL_ID = 8
DRAFT_VOCAB = 128
# build_run_inputs: its own tiny verifier (8 layers), N_ROWS samples of which N_TRAIN train.
HIDDEN = 64
VOCAB = 512
N_ROWS = 24
N_TRAIN = 18


def build_workspace(
    root: Path,
    verifier_dir: Path,
    *,
    n_train: int = 24,
    n_val: int = 6,
    train: dict[str, Any] | None = None,
) -> Path:
    """Write data/{hidden_states,tokenized,vocab} and params.yaml under `root`; return it."""
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    from eagle3_pipeline.store import format as store

    config = json.loads((verifier_dir / "config.json").read_text())
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    layout = store.StoreLayout(
        AUX_IDS, FINAL_ID, hidden, "bf16", {"name_or_path": str(verifier_dir)}
    )
    gen = torch.Generator().manual_seed(0)
    rows: dict[str, list[dict[str, Any]]] = {"train": [], "val": []}
    samples, freq = [], {}
    for i in range(n_train + n_val):
        split = "train" if i < n_train else "val"
        seq = int(torch.randint(24, 49, (1,), generator=gen))
        ids = torch.randint(0, vocab, (seq,), generator=gen)
        mask = torch.tensor([0] * (seq // 4) + [1] * (seq - seq // 4))
        hs = torch.randn(seq, len(AUX_IDS) + 1, hidden, generator=gen)
        sid = f"s{i:03d}"
        samples.append((sid, hs, ids, mask))
        rows[split].append(
            {"id": sid, "input_ids": ids.tolist(), "loss_mask": mask.tolist(), "split": split}
        )
        for token, m in zip(ids.tolist(), mask.tolist(), strict=True):
            freq[token] = freq.get(token, 0) + m
    store_dir = root / "data/hidden_states"
    entries = store.write_samples(store_dir, samples, layout)
    store.write_manifest(
        store_dir, layout, {s[0]: e for s, e in zip(samples, entries, strict=True)}
    )
    tok = root / "data/tokenized"
    tok.mkdir(parents=True)
    for split, split_rows in rows.items():
        (tok / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in split_rows))
    d2t, t2d = build_vocab_mappings_from_distribution(freq, DRAFT_VOCAB, vocab)
    (root / "data/vocab").mkdir(parents=True)
    np.save(root / "data/vocab/d2t.npy", d2t.numpy())
    np.save(root / "data/vocab/t2d.npy", t2d.numpy())
    params = {
        "verifier": {"source": "pretrained", "path": str(verifier_dir)},
        "layers": {"aux_layer_ids": AUX_IDS, "final_layer_id": FINAL_ID},
        "vocab": {"draft_vocab_size": DRAFT_VOCAB},
        "train": {
            "epochs": 3,
            "lr": 3e-3,
            "noise_std": 0.2,
            "max_tokens_per_batch": 160,
            "log_every_steps": 1,
        }
        | (train or {}),
    }
    (root / "params.yaml").write_text(yaml.safe_dump(params))
    return root


def stage_command() -> list[str]:
    return [sys.executable, "-m", "eagle3_pipeline.cli", "train", "--params", "params.yaml"]


def stage_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", TQDM_DISABLE="1")
    return env


def run_stage(root: Path) -> str:
    """Run `eagle3 train` in `root`; fail with its output when it does not exit 0."""
    proc = subprocess.run(
        stage_command(), cwd=root, env=stage_env(), capture_output=True, text=True
    )
    assert proc.returncode == 0, f"train failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout


def checkpoints(root: Path) -> Path:
    return root / "data/.work/train/checkpoints"


def kill_during_epoch_2(root: Path) -> None:
    """Start `eagle3 train` in `root`; SIGKILL it once a step of epoch 2 (index 1) is logged,
    after checking epoch 1's completion marker exists."""
    import signal

    import pytest

    from eagle3_pipeline.training import checkpoints as ck

    marker = checkpoints(root) / "0" / ck.COMPLETE_MARKER
    proc = subprocess.Popen(
        stage_command(),
        cwd=root,
        env=stage_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("[train] epoch 1 step"):  # a step of epoch 2 is done
                assert marker.is_file(), "epoch 1 logged steps before its marker existed"
                proc.send_signal(signal.SIGKILL)
                break
        else:
            pytest.fail("the run ended before epoch 2 started")
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL


def build_run_inputs(root: Path) -> dict[str, Any]:
    """A tiny verifier, N_ROWS samples with random hidden states, and a d2t/t2d pair."""
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution
    from transformers import LlamaConfig, LlamaForCausalLM

    from eagle3_pipeline.training.data import TrainingSample

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
    samples: list[TrainingSample] = []
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

    d2t, t2d = build_vocab_mappings_from_distribution(freq, DRAFT_VOCAB, VOCAB)
    np.save(root / "d2t.npy", d2t.numpy())
    np.save(root / "t2d.npy", t2d.numpy())
    return {"root": root, "samples": samples}


def tiny_settings(inputs: dict[str, Any], run_dir: Path, **overrides: Any) -> Any:
    """TrainSettings for one epoch on `build_run_inputs`, data and checkpoints in run_dir;
    `overrides` name train knobs (TrainParams fields) or settings fields."""
    from builders import train_params

    from eagle3_pipeline.config.training_params import TrainParams
    from eagle3_pipeline.training.data import train_data_ratio_for
    from eagle3_pipeline.training.run import TrainSettings

    knobs = {k: overrides.pop(k) for k in list(overrides) if k in TrainParams.model_fields}
    train = train_params(scheduler="cosine", warmup_ratio=0.1)
    settings = TrainSettings(
        train=train.model_copy(update=knobs),  # unvalidated: run_training's own checks refuse
        data_dir=run_dir / "data",
        verifier_dir=inputs["root"] / "verifier",
        save_dir=run_dir / "ckpt",
        d2t_path=inputs["root"] / "d2t.npy",
        t2d_path=inputs["root"] / "t2d.npy",
        draft_vocab_size=DRAFT_VOCAB,
        target_layer_ids=AUX_IDS,
        train_data_ratio=train_data_ratio_for(N_TRAIN, N_ROWS),
    )
    return replace(settings, **overrides)


def train_tiny(
    inputs: dict[str, Any], run_dir: Path, on_metrics: Any = None, **overrides: Any
) -> list[tuple[int, dict]]:
    """Run `run_training` on `tiny_settings`; the metric dicts it logged, with their steps."""
    from eagle3_pipeline.training.data import write_training_data
    from eagle3_pipeline.training.run import run_training

    settings = tiny_settings(inputs, run_dir, **overrides)
    if not settings.data_dir.exists():
        write_training_data(settings.data_dir, inputs["samples"])
    metrics: list[tuple[int, dict]] = []
    run_training(settings, on_metrics or (lambda m, step: metrics.append((step, m))))
    return metrics


def verifier_head_rows(inputs: dict[str, Any]) -> torch.Tensor:
    """The verifier's lm_head rows of the draft vocab (build_run_inputs), in bf16 as saved."""
    verifier = load_file(inputs["root"] / "verifier" / "model.safetensors")
    t2d = torch.from_numpy(np.load(inputs["root"] / "t2d.npy"))
    return verifier["lm_head.weight"][t2d].to(torch.bfloat16)
