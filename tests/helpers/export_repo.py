"""A workspace as stage `export` finds it, the params that drive it, and the run itself."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import torch
from drafter_fixtures import build_drafter, mapping

from eagle3_pipeline.config.params import Params
from eagle3_pipeline.stages import export

AUX = [2, 4, 7]  # 7: the last layer's input, so a drafter that reads it predicts the verifier
DRAFT_IDS = list(range(0, 256))
K = 3


def make_repo(root: Path, verifier: Path, legacy: bool = False) -> Path:
    """A workspace as export finds it: data/verifier, data/vocab, models/trained/best.

    The drafter is random except that it predicts from the last layer's input through the
    verifier's own lm_head rows (fc reads aux block 3, attention and MLP outputs are zero),
    so vLLM accepts some of its drafts and every norm flag changes which ones. `legacy` wires it
    as SpecForge does (every flag false), as a run initialised from such a drafter trains it.
    """
    root.mkdir(parents=True, exist_ok=True)
    shutil.copytree(verifier, root / "data" / "verifier")
    cwd = Path.cwd()
    os.chdir(root)
    try:
        model = build_drafter(
            Path("data/verifier"),
            DRAFT_IDS,
            AUX,
            seed=5,
            random_head=False,
            legacy_flags=legacy,
        )
    finally:
        os.chdir(cwd)
    h = model.hidden_size
    with torch.no_grad():
        model.fc.weight.zero_()
        model.fc.weight[:, 2 * h :] = torch.eye(h)
        model.layers[0].self_attn.o_proj.weight.zero_()
        model.layers[0].mlp.down_proj.weight.zero_()
    model.to(torch.bfloat16).save_pretrained(root / "models" / "trained" / "best")
    d2t, t2d = mapping(DRAFT_IDS, model.verifier_vocab_size)
    (root / "data" / "vocab").mkdir(parents=True)
    np.save(root / "data" / "vocab" / "d2t.npy", d2t.numpy())
    np.save(root / "data" / "vocab" / "t2d.npy", t2d.numpy())
    return root


SPECFORGE_FLAGS = dict.fromkeys(
    ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"), False
)


def params(fmt: str = "flat", server: str = "vllm", flags: dict | None = None) -> Params:
    return Params.model_validate(
        {
            "layers": {"aux_layer_ids": AUX},
            "train": {"flags": flags or {}},
            "vocab": {"draft_vocab_size": len(DRAFT_IDS)},
            "export": {"format": fmt, "server": server},
            "evaluate": {"num_speculative_tokens": K},
        }
    )


def run_export(root: Path, p: Params) -> dict:
    cwd = Path.cwd()
    os.chdir(root)
    try:
        export.run(p)
    finally:
        os.chdir(cwd)
    return json.loads((root / "models" / "drafter" / "config.json").read_text())
