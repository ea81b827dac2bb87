"""The tiny MLA verifier: Kimi-K2.5's layout (a DeepSeek-V3 text model under a multimodal
wrapper, transformers' own Kimi_K25 classes) in miniature, saved as the hub lays Kimi out.
"""

from __future__ import annotations

from pathlib import Path

from eagle3_pipeline.config.params import TinyVerifierParams
from eagle3_pipeline.core import atomic
from eagle3_pipeline.core.errors import DataError

# DeepSeek-V3 text model, Kimi-K2.5's shape in miniature. vLLM's CPU MLA kernel needs
# kv_lora_rank + qk_rope_head_dim == 576, so those two keep DeepSeek-V3's real values; the MoE
# keeps its structure (1 dense layer first, routed experts + 1 shared, sigmoid routing with the
# e_score_correction_bias of noaux_tc) at a size derived from the tiny params.
MLA_KV_LORA_RANK = 512
MLA_ROPE_HEAD_DIM = 64
MOE_ROUTED_EXPERTS = 8
MOE_EXPERTS_PER_TOKEN = 2
# The smallest MoonViT tower Kimi_K25Config accepts: the weights must exist for transformers to
# load the wrapper, and vLLM skips the tower when images are disabled (vision_chunk: 0).
TINY_VISION = {
    "patch_size": 14,
    "num_hidden_layers": 1,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 2,
    "pos_emb_height": 8,
    "pos_emb_width": 8,
}
# vLLM's Kimi-K2.5 processor reads this file even when images are disabled; these are the
# values of the real model's preprocessor_config.json.
KIMI_MEDIA_PROC_CFG = {
    "in_patch_limit": 16384,
    "patch_size": 14,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "merge_kernel_size": 2,
    "fixed_output_tokens": None,
    "patch_limit_on_one_side": 512,
    "in_patch_limit_each_frame": 4096,
    "in_patch_limit_video": None,
    "sample_fps": 2.0,
    "max_num_frames_each_video": None,
    "temporal_merge_kernel_size": 4,
    "timestamp_mode": "hh:mm:ss.fff",
    "config_type": "image",
}


def build_kimi_like(tiny: TinyVerifierParams, tokenizer):
    """Kimi-K2.5's layout: a DeepSeek-V3 language model under `text_config` of a multimodal
    wrapper (transformers' own Kimi_K25 classes: no remote code)."""
    from transformers import DeepseekV3Config
    from transformers.models.kimi_k25 import Kimi_K25Config, Kimi_K25ForConditionalGeneration

    head_dim = tiny.hidden_size // tiny.num_attention_heads
    text = DeepseekV3Config(
        vocab_size=len(tokenizer),
        hidden_size=tiny.hidden_size,
        intermediate_size=tiny.intermediate_size,
        moe_intermediate_size=max(tiny.intermediate_size // 4, 8),
        num_hidden_layers=tiny.num_hidden_layers,
        num_attention_heads=tiny.num_attention_heads,
        num_key_value_heads=tiny.num_attention_heads,  # MLA: one latent, every head reads it
        n_shared_experts=1,
        n_routed_experts=MOE_ROUTED_EXPERTS,
        num_experts_per_tok=MOE_EXPERTS_PER_TOKEN,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        kv_lora_rank=MLA_KV_LORA_RANK,
        q_lora_rank=tiny.hidden_size // 2,
        qk_rope_head_dim=MLA_ROPE_HEAD_DIM,
        qk_nope_head_dim=head_dim,
        v_head_dim=head_dim,
        max_position_embeddings=tiny.max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    n = len(tokenizer)  # media placeholders outside the text vocab: no text token collides
    config = Kimi_K25Config(
        text_config=text.to_dict(),
        vision_config=TINY_VISION,
        projection_hidden_size=TINY_VISION["hidden_size"],
        image_token_id=n,
        video_token_id=n + 1,
        vision_start_token_id=n + 2,
        vision_end_token_id=n + 3,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return Kimi_K25ForConditionalGeneration(config)


def save_kimi_like(model, out_dir: Path) -> None:
    """Write the wrapper as Kimi-K2.5's checkpoint is laid out on the hub, which vLLM loads.

    transformers 5.19 reverses its Kimi weight renames imperfectly on save (decoder layers come
    out as `language_model.model.blocks.*`, the projector norm under `model.`); the hub names
    are restored here and the file is read back through transformers to prove it loads as built.
    config.json gets what transformers does not write but vLLM needs: `topk_method: noaux_tc`
    and `scoring_func: sigmoid` (what transformers' DeepSeek-V3 computes; vLLM would otherwise
    default to softmax routing) and vLLM's architecture name for the wrapper.
    """
    import json
    import re

    import torch
    from safetensors.torch import load_file, save_file

    model.save_pretrained(out_dir, safe_serialization=True)
    weights_file = out_dir / "model.safetensors"
    renames = [
        (re.compile(r"^language_model\.model\.blocks\."), "language_model.model.layers."),
        (re.compile(r"^model\.mm_projector\."), "mm_projector."),
    ]
    tensors = {}
    for key, value in load_file(weights_file).items():
        for pattern, repl in renames:
            key = pattern.sub(repl, key)
        tensors[key] = value
    save_file(tensors, weights_file, metadata={"format": "pt"})
    cfg_file = out_dir / "config.json"
    config = json.loads(cfg_file.read_text())
    config["architectures"] = ["KimiK25ForConditionalGeneration"]
    # Kimi-K2.5's own key (read by vLLM's EAGLE-3 proposer for Kimi targets), = image_token_id.
    config["media_placeholder_token_id"] = config["image_token_id"]
    config["text_config"] |= {
        "architectures": ["DeepseekV3ForCausalLM"],
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "dtype": config.get("dtype", "float32"),
    }
    atomic.write_json(cfg_file, config)
    atomic.write_json(out_dir / "preprocessor_config.json", {"media_proc_cfg": KIMI_MEDIA_PROC_CFG})
    reloaded = type(model).from_pretrained(out_dir, dtype=torch.float32).eval()
    probe = torch.arange(3, 35).unsqueeze(0) % model.config.text_config.vocab_size
    with torch.no_grad():
        if not torch.allclose(reloaded(input_ids=probe).logits, model(input_ids=probe).logits):
            raise DataError(f"{out_dir}: the saved verifier does not reload as built")
