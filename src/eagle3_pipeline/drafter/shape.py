"""The drafter's shape and parameter count, from config files alone (no torch, no weights).

The shape comes from an init checkpoint's config.json or, without one, from the verifier's, as
speculators would build it. The counts follow speculators 0.9.0's `Eagle3DraftModel`
(tests/unit/drafter/test_shape.py checks them against an instantiated model).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3_pipeline.core.errors import CheckpointError
from eagle3_pipeline.drafter.conventions import RunConventions, read_conventions
from eagle3_pipeline.verifier import identity as vf


@dataclass(frozen=True)
class DrafterShape:
    """One EAGLE-3 decoder layer (Llama) plus heads, from an init checkpoint or the verifier."""

    source: str
    hidden_size: int
    target_vocab_size: int
    draft_vocab_size: int
    aux_layer_ids: list[int] | None  # in vLLM's convention
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    attention_bias: bool
    mlp_bias: bool
    norm_before_fc: bool
    fc_norm: bool = False
    config_file: Path | None = None


@dataclass(frozen=True)
class ParamGroup:
    """The parameters of one module of the drafter, and whether training updates them."""

    name: str
    shape: str
    count: int
    trainable: bool


def _int(cfg: dict[str, Any], key: str, where: Path) -> int:
    value = cfg.get(key)
    if not isinstance(value, int):
        raise CheckpointError(f"{where}: no integer {key}: is this an EAGLE-3 drafter config?")
    return value


def drafter_from_init(config: dict[str, Any], where: Path) -> DrafterShape:
    """Both formats: speculators (`transformer_layer_config`) and legacy flat (EAGLE/SpecForge)."""
    conv = read_conventions(config, where)
    layer = conv.layer_config
    hidden = _int(layer, "hidden_size", where)
    heads = _int(layer, "num_attention_heads", where)
    target_vocab = _int(layer, "vocab_size", where)
    arch = "speculators" if conv.origin == "speculators" else "legacy flat"
    return DrafterShape(
        source=f"init checkpoint {where} ({arch}, {', '.join(config.get('architectures', []))})",
        hidden_size=hidden,
        target_vocab_size=target_vocab,
        draft_vocab_size=conv.draft_vocab_size,
        aux_layer_ids=conv.vllm_aux_layer_ids,
        intermediate_size=_int(layer, "intermediate_size", where),
        num_attention_heads=heads,
        num_key_value_heads=int(layer.get("num_key_value_heads") or heads),
        head_dim=int(layer.get("head_dim") or hidden // heads),
        attention_bias=bool(layer.get("attention_bias", False)),
        mlp_bias=bool(layer.get("mlp_bias", False)),
        norm_before_fc=conv.flags["norm_before_fc"],
        fc_norm=conv.flags["fc_norm"],
        config_file=where,
    )


def drafter_from_verifier(
    config: dict[str, Any], draft_vocab_size: int, conventions: RunConventions
) -> DrafterShape:
    """What speculators builds without an init checkpoint: a Llama layer shaped like the verifier.

    Mirrors speculators.train.cli.create_transformer_layer_config on the raw config.json (an MoE
    verifier without a dense intermediate_size gets 3 x hidden).
    """
    tc = vf.text_config(config)
    hidden, heads = int(tc["hidden_size"]), int(tc["num_attention_heads"])
    kv_heads = int(tc.get("num_key_value_heads") or heads)
    head_dim = tc.get("head_dim")
    if head_dim and hidden % heads and not hidden % head_dim:
        heads = hidden // head_dim
        kv_heads = kv_heads if heads % kv_heads == 0 else heads
    return DrafterShape(
        source="verifier config + speculators defaults (no train.init_from)",
        hidden_size=hidden,
        target_vocab_size=int(tc["vocab_size"]),
        draft_vocab_size=draft_vocab_size,
        aux_layer_ids=conventions.aux_layer_ids,
        intermediate_size=int(tc.get("intermediate_size") or 3 * hidden),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=int(head_dim or hidden // heads),
        attention_bias=False,
        mlp_bias=False,
        norm_before_fc=conventions.flags["norm_before_fc"],
        fc_norm=conventions.flags["fc_norm"],
    )


def _linear(n_in: int, n_out: int, bias: bool) -> int:
    return n_in * n_out + (n_out if bias else 0)


def parameter_groups(d: DrafterShape, n_aux: int, train_lm_head: bool) -> list[ParamGroup]:
    """Eagle3DraftModel's parameters by module, from shapes alone (no torch).

    The one decoder layer's q/k/v read 2H (token embedding + hidden state); `verifier_lm_head`
    is speculators' frozen copy of the verifier's lm_head rows for the draft vocab (the targets).
    """
    h, n_in = d.hidden_size, n_aux * d.hidden_size
    q_out = d.num_attention_heads * d.head_dim
    kv_out = d.num_key_value_heads * d.head_dim
    inter, bias = d.intermediate_size, d.attention_bias
    attention = (
        _linear(2 * h, q_out, bias) + 2 * _linear(2 * h, kv_out, bias) + _linear(q_out, h, bias)
    )
    mlp = 2 * _linear(h, inter, d.mlp_bias) + _linear(inter, h, d.mlp_bias)
    # input_layernorm, hidden_norm, post_attention_layernorm, final norm; before fc either one
    # input_norm over n*H (norm_before_fc) or one norm per aux layer (fc_norm): n*H either way.
    fc_input_norm = d.norm_before_fc or d.fc_norm
    norms = 4 * h + (n_in if fc_input_norm else 0)
    norm_names = f"4 x {h:,}" + (f" + input_norm {n_in:,}" if fc_input_norm else "")
    heads = f"{d.draft_vocab_size:,} x {h:,}"
    vocab = d.target_vocab_size
    attention_shape = f"qkv {2 * h:,} -> {q_out:,}+2x{kv_out:,}, o -> {h:,}"
    return [
        ParamGroup("embed_tokens", f"{vocab:,} x {h:,}", vocab * h, False),
        ParamGroup("fc", f"{n_in:,} -> {h:,}", n_in * h, True),
        ParamGroup("attention", attention_shape, attention, True),
        ParamGroup("mlp", f"{h:,} -> {inter:,} -> {h:,}", mlp, True),
        ParamGroup("norms", norm_names, norms, True),
        ParamGroup("lm_head", heads, d.draft_vocab_size * h, train_lm_head),
        ParamGroup("verifier_lm_head", heads, d.draft_vocab_size * h, False),
        ParamGroup("verifier_norm", f"{h:,}", h, False),
    ]
