"""Tiny EAGLE-3 drafters built in tests, in speculators' format and AQ-MedAI's legacy flat one."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from builders import model_files
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

HIDDEN = 64
VOCAB = 512
N_LAYERS = 8


def build_llama_verifier(out: Path, seed: int = 0, **overrides: object) -> Path:
    """A random 8-layer Llama saved as safetensors (no tokenizer: enough for speculators)."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        num_hidden_layers=N_LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=128,
        vocab_size=VOCAB,
        max_position_embeddings=512,
        **overrides,
    )
    LlamaForCausalLM(config).save_pretrained(out)
    return out


def mapping(
    target_ids: list[int] | torch.Tensor, n_target: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """d2t (offsets) and t2d (mask) for a draft vocab made of `target_ids`, in draft order."""
    ids = torch.as_tensor(target_ids, dtype=torch.long).sort().values
    d2t = ids - torch.arange(len(ids))
    t2d = torch.zeros(n_target, dtype=torch.bool)
    t2d[ids] = True
    return d2t, t2d


def build_drafter(
    verifier: Path,
    target_ids: list[int] | torch.Tensor,
    aux: list[int],
    seed: int,
    legacy_flags: bool = False,
    random_head: bool = True,
    perturb_norms: bool = True,
    ttt_steps: int = 3,
):
    """A speculators Eagle3DraftModel (fp32) as `from_training_args` builds it for training.

    `legacy_flags` builds it as AQ-MedAI/SpecForge drafters are wired (all norm flags false);
    `random_head` replaces the verifier rows speculators puts in lm_head, so that a test can
    tell rows apart by origin; `perturb_norms` moves norm weights away from 1 so a lost norm
    is visible. Without both it is exactly the untrained drafter training would start from.
    """
    from speculators.models.eagle3.core import Eagle3DraftModel
    from speculators.train.cli import create_transformer_layer_config

    layer_config = create_transformer_layer_config(
        verifier_name_or_path=str(verifier),
        num_layers=1,
        draft_arch="llama",
        hidden_act=None,
        sliding_window=2048,
        full_attention_indices=[],
    )
    d2t, t2d = mapping(target_ids, layer_config.vocab_size)
    torch.manual_seed(seed)
    model = Eagle3DraftModel.from_training_args(
        verifier_config=layer_config,
        t2d=t2d,
        d2t=d2t,
        target_layer_ids=aux,
        verifier_name_or_path=str(verifier),
        draft_vocab_size=len(d2t),
        norm_before_residual=not legacy_flags,
        norm_before_fc=not legacy_flags,
        norm_output=not legacy_flags,
        ttt_steps=ttt_steps,
        draft_attn_impl="sdpa",
    )
    with torch.no_grad():
        if random_head:
            model.lm_head.weight.normal_(0.0, 0.05)
        for name, p in model.named_parameters():
            if perturb_norms and name.endswith("norm.weight") and not name.startswith("verifier"):
                p.uniform_(0.5, 1.5)
    return model


def save_legacy_flat(model, out: Path, sglang_aux: list[int]) -> Path:
    """The drafter as AQ-MedAI ships one: flat names, Llama config, no norm flags, no
    embed_tokens, aux ids in SGLang's convention."""
    tl = model.config.transformer_layer_config
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": tl.hidden_size,
        "intermediate_size": tl.intermediate_size,
        "num_attention_heads": tl.num_attention_heads,
        "num_key_value_heads": tl.num_key_value_heads,
        "head_dim": tl.head_dim,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": tl.rms_norm_eps,
        "max_position_embeddings": tl.max_position_embeddings,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "vocab_size": tl.vocab_size,
        "draft_vocab_size": model.config.draft_vocab_size,
        "tie_word_embeddings": False,
        "dtype": "bfloat16",
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": sglang_aux,
            "use_aux_hidden_state": True,
        },
    }
    skip = ("verifier_", "embed_tokens", "input_norm")
    tensors = {
        k.replace("layers.0.", "midlayer."): v.detach().to(torch.bfloat16).contiguous()
        if v.is_floating_point()
        else v.contiguous()
        for k, v in model.state_dict().items()
        if not k.startswith(skip)
    }
    out.mkdir(parents=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return model_files(out, config=json.dumps(config, indent=2))
