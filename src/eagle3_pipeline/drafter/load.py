"""Load EAGLE-3 drafters (speculators or flat format) for checks and simulation, on CPU or GPU.

The drafter's config flags are the contract with the server: `expected_config` derives them from
the run's conventions (drafter.conventions, the trainer's source too), and `check_config`
refuses a checkpoint that disagrees. A flat
export (flat_format.py) is read back through the same speculators model, so the checks and the
offline simulation see exactly the function the server computes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eagle3_pipeline.core.errors import CheckpointError
from eagle3_pipeline.drafter import flat_format
from eagle3_pipeline.drafter.conventions import (
    FLAGS,
    LAYER_SHAPE_FIELDS,
    RunConventions,
    read_conventions,
)
from eagle3_pipeline.drafter.flex_kernel import flex_attention_main_kernel


def compute_placement() -> tuple[torch.device, torch.dtype]:
    """Where simulations run: the GPU in bf16 where there is one (a Kimi drafter's 163,840-row
    head in fp32 on CPU takes hours), else the CPU in fp32 (the tiny profiles' numbers)."""
    if torch.cuda.is_available():
        return torch.device("cuda"), torch.bfloat16
    return torch.device("cpu"), torch.float32


def attn_impl() -> str:
    return "simple_flex_attention" if torch.cuda.is_available() else "sdpa"


def is_flat(path: str | Path) -> bool:
    """Whether a drafter directory holds the flat layout (else speculators')."""
    raw = json.loads((Path(path) / "config.json").read_text())
    return raw.get("speculators_model_type") is None


def _config(path: Path, verifier_path: str | Path):  # -> Eagle3SpeculatorConfig
    """The speculators config of a drafter directory in either format, bound to a local verifier.

    The saved config names the verifier as users know it (a hub id, say); speculators resolves
    that name to read the verifier's config and weights. In memory it is replaced by the local
    directory the run uses, so loading never reaches a hub, and the file keeps its name.
    """
    from speculators.models.eagle3.core import Eagle3DraftModel

    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path}/config.json: not found: run the train/export stage")
    raw = json.loads((path / "config.json").read_text())
    if raw.get("speculators_model_type") is not None:
        config = Eagle3DraftModel.config_class.from_pretrained(str(path))
    else:
        verifier = (raw.get("eagle3_pipeline") or {}).get("verifier", {}).get("name_or_path")
        config = Eagle3DraftModel.config_class.from_dict(
            flat_format.to_speculators_config(raw, verifier)
        )
    return _bind_local(config, path, verifier_path)


def _bind_local(config, path: Path, verifier_path: str | Path):
    """`config` with this machine's attention kernels and the run's local verifier directory."""
    impl = attn_impl()
    config.transformer_layer_config._attn_implementation = impl  # noqa: SLF001
    if impl == "simple_flex_attention":
        flex_attention_main_kernel()  # short samples would take flex-decoding and fail
    if not (Path(verifier_path) / "config.json").is_file():
        raise CheckpointError(
            f"{verifier_path}/config.json: not found: the drafter in {path} needs its verifier's "
            "local directory (verifier.path in params.yaml)"
        )
    config.speculators_config.verifier.name_or_path = str(verifier_path)
    return config


def load_parallel_drafter(
    path: str | Path,
    verifier_path: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    family: str = "dflash",
):  # -> DFlashDraftModel | PEagleDraftModel
    """A parallel drafter's checkpoint (speculators format; `family` dflash or peagle) with the
    verifier tensors it shares (embeddings) read from `verifier_path`, in `dtype` on `device`."""
    from speculators.models.dflash.core import DFlashDraftModel
    from speculators.models.peagle.core import PEagleDraftModel

    model_class = {"dflash": DFlashDraftModel, "peagle": PEagleDraftModel}[family]
    path = Path(path)
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path}/config.json: not found: run the family@ branch")
    config = model_class.config_class.from_pretrained(str(path))
    config = _bind_local(config, path, verifier_path)
    model = model_class.from_pretrained(str(path), config=config)
    return model.to(device=device, dtype=dtype).eval()


def load_drafter(
    path: str | Path,
    verifier_path: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
):  # -> Eagle3DraftModel
    """A drafter directory as the server computes it, its verifier tensors read from
    `verifier_path` (never from the name its config records); in `dtype` on `device`."""
    from speculators.models.eagle3.core import Eagle3DraftModel

    path = Path(path)
    config = _config(path, verifier_path)
    if not is_flat(path):
        model = Eagle3DraftModel.from_pretrained(str(path), config=config)
        return model.to(device=device, dtype=dtype).eval()
    # Flat: the same model class, its tensors renamed back (midlayer. -> layers.0.).
    ckpt = flat_format.open_checkpoint(path)
    # In the saved dtype, as from_pretrained builds it: the verifier rows loaded below then
    # round exactly as they do for a speculators directory.
    dtype = getattr(
        torch, str(ckpt.config.get("dtype") or ckpt.config.get("torch_dtype") or "float32")
    )
    model = Eagle3DraftModel(config).to(dtype)
    state = {name: ckpt.tensor(name) for name in ckpt.names()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    allowed = set(Eagle3DraftModel._keys_to_ignore_on_load_missing)  # noqa: SLF001
    bad_missing = [k for k in missing if k not in allowed]
    if unexpected or bad_missing:
        raise CheckpointError(
            f"{path}/model.safetensors: missing {bad_missing}, unexpected {unexpected}: not an "
            "export of this pipeline's drafter; re-run the export stage"
        )
    model.load_verifier_weights()
    return model.to(device=device, dtype=dtype).eval()


def fresh_drafter_like(
    path: str | Path,
    verifier_path: str | Path,
    d2t: torch.Tensor,
    t2d: torch.Tensor,
    seed: int,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
):
    """An untrained drafter of the same shape: the baseline that training must beat."""
    from speculators.models.eagle3.core import Eagle3DraftModel

    config = _config(Path(path), verifier_path)
    torch.manual_seed(seed)
    model = Eagle3DraftModel(config)
    model.load_vocab_mappings(t2d, d2t)
    model.load_verifier_weights()
    return model.to(device=device, dtype=dtype).eval()


def load_mapping(vocab_dir: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    vocab_dir = Path(vocab_dir)
    d2t = torch.from_numpy(np.load(vocab_dir / "d2t.npy", allow_pickle=False))
    t2d = torch.from_numpy(np.load(vocab_dir / "t2d.npy", allow_pickle=False))
    return d2t, t2d


def expected_config(conventions: RunConventions, draft_vocab_size: int, verifier_name: str) -> dict:
    """What a drafter trained under `conventions` must say; vLLM must apply the same norms to
    the same layers or acceptance collapses."""
    expected = {
        "eagle_aux_hidden_state_layer_ids": conventions.aux_layer_ids,
        "draft_vocab_size": draft_vocab_size,
        "verifier_name_or_path": verifier_name,
        **conventions.flags,
    }
    if conventions.layer_config is not None:
        expected |= {
            f"layer.{k}": conventions.layer_config.get(k)
            for k in LAYER_SHAPE_FIELDS
            if conventions.layer_config.get(k) is not None
        }
    return expected


def config_view(config: dict[str, Any], where: str | Path = "config.json") -> dict[str, Any]:
    """The fields of a saved drafter config.json that `expected_config` speaks about.

    Read through `read_conventions` in either format: aux ids in vLLM's convention, flags in
    vLLM's meaning; the verifier from a flat file's `eagle3_pipeline` record.
    """
    conv = read_conventions(config, where)
    if conv.origin == "speculators":
        verifier = config.get("speculators_config", {}).get("verifier", {}).get("name_or_path")
    else:
        verifier = (config.get("eagle3_pipeline") or {}).get("verifier", {}).get("name_or_path")
    return {
        "eagle_aux_hidden_state_layer_ids": conv.vllm_aux_layer_ids,
        "draft_vocab_size": conv.draft_vocab_size,
        "verifier_name_or_path": verifier,
        **{k: conv.flags[k] for k in FLAGS},
        **{f"layer.{k}": conv.layer_config.get(k) for k in LAYER_SHAPE_FIELDS},
    }


def check_config(path: str | Path, expected: dict[str, Any]) -> None:
    config = json.loads((Path(path) / "config.json").read_text())
    got = config_view(config, Path(path) / "config.json")
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
