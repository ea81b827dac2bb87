"""Load EAGLE-3 drafters (speculators format) for checks and simulation, on CPU or GPU.

The drafter's config flags are the contract with the server: `expected_config` derives them from
the same params the trainer used, and `check_config` refuses a checkpoint that disagrees.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eagle3_pipeline.errors import CheckpointError

# speculators 0.9.0 writes these as true; vLLM must apply the same norms or acceptance collapses.
SERVING_FLAGS = {"norm_before_fc": True, "norm_output": True}


def _attn_impl() -> str:
    return "simple_flex_attention" if torch.cuda.is_available() else "sdpa"


def load_drafter(path: str | Path):  # -> Eagle3DraftModel
    from speculators.models.eagle3.core import Eagle3DraftModel

    path = Path(path)
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path}/config.json: not found: run the train/export stage")
    config = Eagle3DraftModel.config_class.from_pretrained(str(path))
    config.transformer_layer_config._attn_implementation = _attn_impl()  # noqa: SLF001
    model = Eagle3DraftModel.from_pretrained(str(path), config=config)
    return model.float().eval()


def fresh_drafter_like(path: str | Path, d2t: torch.Tensor, t2d: torch.Tensor, seed: int):
    """An untrained drafter of the same shape: the baseline that training must beat."""
    from speculators.models.eagle3.core import Eagle3DraftModel

    config = Eagle3DraftModel.config_class.from_pretrained(str(path))
    config.transformer_layer_config._attn_implementation = _attn_impl()  # noqa: SLF001
    torch.manual_seed(seed)
    model = Eagle3DraftModel(config)
    model.load_vocab_mappings(t2d, d2t)
    model.load_verifier_weights()
    return model.float().eval()


def load_mapping(vocab_dir: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    vocab_dir = Path(vocab_dir)
    d2t = torch.from_numpy(np.load(vocab_dir / "d2t.npy", allow_pickle=False))
    t2d = torch.from_numpy(np.load(vocab_dir / "t2d.npy", allow_pickle=False))
    return d2t, t2d


def expected_config(aux_layer_ids: list[int], draft_vocab_size: int, verifier_name: str) -> dict:
    return {
        "eagle_aux_hidden_state_layer_ids": aux_layer_ids,
        "draft_vocab_size": draft_vocab_size,
        "verifier_name_or_path": verifier_name,
        **SERVING_FLAGS,
    }


def config_view(config: dict[str, Any]) -> dict[str, Any]:
    """The fields of a saved drafter config.json that `expected_config` speaks about."""
    return {
        "eagle_aux_hidden_state_layer_ids": config.get("eagle_aux_hidden_state_layer_ids"),
        "draft_vocab_size": config.get("draft_vocab_size"),
        "verifier_name_or_path": config.get("speculators_config", {})
        .get("verifier", {})
        .get("name_or_path"),
        **{k: config.get(k) for k in SERVING_FLAGS},
    }


def check_config(path: str | Path, expected: dict[str, Any]) -> None:
    config = json.loads((Path(path) / "config.json").read_text())
    got = config_view(config)
    diff = {k: (got[k], v) for k, v in expected.items() if got[k] != v}
    if diff:
        parts = ", ".join(f"{k}: checkpoint {a!r} vs params {b!r}" for k, (a, b) in diff.items())
        raise CheckpointError(f"{path}/config.json disagrees with params ({parts}): retrain")


def check_mapping(model, d2t: torch.Tensor, t2d: torch.Tensor, where: str | Path) -> None:
    """A drafter's lm_head rows belong to its own d2t: never pair them with another mapping."""
    if (
        model.d2t is None
        or not torch.equal(model.d2t.cpu().long(), d2t.long())
        or not torch.equal(model.t2d.cpu().bool(), t2d.bool())
    ):
        raise CheckpointError(
            f"{where}: the checkpoint's d2t/t2d differ from data/vocab: its lm_head rows would "
            "map to the wrong tokens; retrain or rebuild the vocab the checkpoint was trained with"
        )
