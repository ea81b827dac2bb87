"""A small workspace for the `train` stage: synthetic store, tokenized rows, vocab, params.

Shared by the training tests (resume, DDP); the hidden states are random but seeded, so two
workspaces built alike hold identical bytes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

AUX_IDS = [2, 4, 5]
FINAL_ID = 8
DRAFT_VOCAB = 128


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
