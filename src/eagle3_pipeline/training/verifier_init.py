"""Start the drafter from the verifier's own last decoder layer (`train.init_from_verifier`).

speculators already starts embed_tokens from the verifier's embeddings and lm_head from the
verifier's lm_head rows of the draft vocabulary (d2t). This adds, where the shapes allow (the
drafter's layer shaped like the verifier's, as speculators shapes it without --draft-config):
the final norm, and the last decoder layer: its MLP, o_proj and post-attention norm as they
are; q/k/v over the hidden-state half of the drafter's doubled input (the embedding half keeps
speculators' random init, so the token fed in still moves the result), with the layer's input
norm as the hidden-state norm. A pretrained drafter then starts where the verifier's own last
layer points, not from noise: whether that helps is measured (docs/training.md, the recipe).
Hooks `load_verifier_weights` for one `main()` like init_from.py; nothing on resume.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from eagle3_pipeline.core.errors import CheckpointError
from eagle3_pipeline.training.checkpoints import resume_epoch

# drafter tensor -> verifier tensor (under the verifier's last layer prefix, or at the top)
SAME_SHAPE = {
    "layers.0.self_attn.o_proj.weight": "self_attn.o_proj.weight",
    "layers.0.mlp.gate_proj.weight": "mlp.gate_proj.weight",
    "layers.0.mlp.up_proj.weight": "mlp.up_proj.weight",
    "layers.0.mlp.down_proj.weight": "mlp.down_proj.weight",
    "layers.0.post_attention_layernorm.weight": "post_attention_layernorm.weight",
    "layers.0.hidden_norm.weight": "input_layernorm.weight",
}
HIDDEN_HALF = {
    f"layers.0.self_attn.{p}_proj.weight": f"self_attn.{p}_proj.weight" for p in ("q", "k", "v")
}


def verifier_tensors(verifier_dir: str | Path) -> dict[str, tuple[Path, str]]:
    """{name without the model prefix: (file, key)} of the verifier's safetensors files."""
    found: dict[str, tuple[Path, str]] = {}
    for f in sorted(Path(verifier_dir).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            names = fh.keys()
            for key in names:
                found[key.removeprefix("language_model.").removeprefix("model.")] = (f, key)
    return found


def apply(model: Any, verifier_dir: str | Path, num_layers: int) -> list[str]:
    """Copy the verifier's final norm and last layer onto `model`; the names copied."""
    tensors = verifier_tensors(verifier_dir)
    last = f"layers.{num_layers - 1}."
    wanted = {d: last + v for d, v in SAME_SHAPE.items()} | {"norm.weight": "norm.weight"}
    halves = {d: last + v for d, v in HIDDEN_HALF.items()}
    state = model.state_dict()
    copied: list[str] = []
    with torch.no_grad():
        for name, source in (wanted | halves).items():
            if source not in tensors:
                raise CheckpointError(f"{verifier_dir}: no tensor {source}: cannot init from it")
            f, key = tensors[source]
            with safe_open(str(f), framework="pt") as fh:
                value = fh.get_tensor(key)
            target = state[name]
            if name in halves:
                hidden = target.shape[1] // 2
                if target.shape != (value.shape[0], 2 * value.shape[1]):
                    raise CheckpointError(_shape_error(name, target.shape, source, value.shape))
                target[:, hidden:] = value.to(target.dtype)
            else:
                if target.shape != value.shape:
                    raise CheckpointError(_shape_error(name, target.shape, source, value.shape))
                target.copy_(value.to(target.dtype))
            copied.append(name)
    return copied


def _shape_error(name: str, shape: Any, source: str, got: Any) -> str:
    return (
        f"train.init_from_verifier: drafter {name} {tuple(shape)} does not fit the verifier's "
        f"{source} {tuple(got)}: the drafter's layer is not shaped like the verifier's; set "
        "train.init_from_verifier: false"
    )


@contextlib.contextmanager
def init_from_verifier(
    enabled: bool,
    verifier_dir: str | Path,
    num_layers: int,
    save_dir: str | Path,
    on_line: Callable[[str], None],
) -> Iterator[None]:
    """Apply `apply` to the drafter speculators builds inside this block (once; not on resume)."""
    if not enabled or resume_epoch(save_dir) is not None:
        yield
        return
    from speculators.models.eagle3.core import Eagle3DraftModel

    original = Eagle3DraftModel.load_verifier_weights
    done: list[bool] = []

    def load_then_copy(self: Any) -> None:
        original(self)
        if not done:
            copied = apply(self, verifier_dir, num_layers)
            done.append(True)
            on_line(
                f"init from the verifier's last layer ({num_layers - 1}) and final norm: "
                f"{len(copied)} tensors (q/k/v over the hidden-state half)"
            )

    Eagle3DraftModel.load_verifier_weights = load_then_copy
    try:
        yield
    finally:
        Eagle3DraftModel.load_verifier_weights = original
