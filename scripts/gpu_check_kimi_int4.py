"""A tiny Kimi-K2.5 in INT4 for `make gpu-check`'s kimi/* checks: Kimi's wrapper, text_config and
`language_model.` names (verifier/tiny_kimi.py), bf16, its routed experts INT4 group 32 packed by
compressed-tensors' own compressor, and Kimi's quantization_config.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

# Kimi-K2.5's quantization_config (tests/fixtures/kimi-k2.5/config.json): routed experts INT4,
# symmetric, one bf16 scale per 32 weights, packed 8 to an int32; the rest stays bf16.
KIMI_INT4 = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "quantization_status": "compressed",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {
                "num_bits": 4,
                "type": "int",
                "symmetric": True,
                "strategy": "group",
                "group_size": 32,
                "dynamic": False,
                "actorder": None,
                "block_structure": None,
                "observer": "minmax",
                "observer_kwargs": {},
            },
            "input_activations": None,
            "output_activations": None,
        }
    },
    "ignore": [
        "lm_head",
        "re:.*self_attn.*",
        "re:.*shared_experts.*",
        r"re:.*mlp\.(gate|up|gate_up|down)_proj.*",
    ],
    "kv_cache_scheme": None,
}
ROUTED_EXPERT = re.compile(r"\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")
# Kimi-K2.5's head dims (qk_nope = v = 128, MLA latent 512 + rope 64) and dims the INT4 MoE
# kernels take at TP 2 (moe_intermediate 512 = 256 per rank, a multiple of 128).
KIMI_TINY = {
    "architecture": "deepseek_v3",
    "num_hidden_layers": 3,  # 1 dense, then 2 MoE layers
    "hidden_size": 1024,
    "intermediate_size": 2048,  # moe_intermediate_size = 512
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "max_position_embeddings": 4096,
}

def pack_int4(weight: Any) -> dict[str, Any]:
    """A routed expert's weight as compressed-tensors packs it (its own compressor):
    weight_packed int32 [out, in/8], weight_scale bf16 [out, in/32], weight_shape."""
    import torch
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams

    w = KIMI_INT4["config_groups"]["group_0"]["weights"]
    keys = ("num_bits", "type", "symmetric", "strategy", "group_size")
    args = QuantizationArgs(**{k: w[k] for k in keys})
    groups = weight.float().reshape(weight.shape[0], -1, w["group_size"])
    scale, zero = calculate_qparams(groups.amin(-1), groups.amax(-1), args)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    state = {"weight": weight.to(torch.bfloat16), "weight_scale": scale.to(torch.bfloat16)}
    return dict(PackedQuantizationCompressor.compress(state | {"weight_zero_point": zero}, scheme))


def build_tiny_kimi_int4(out_dir: Path, tokenizer_dir: Path, seed: int = 0) -> dict[str, Any]:
    """A random Kimi-K2.5 in miniature as the hub lays it out (verifier/tiny_kimi.py: wrapper,
    text_config, `language_model.` names), bf16, routed experts INT4 group 32 packed by
    compressed-tensors, Kimi's quantization_config. Returns {tensor name: shape}."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    from eagle3_pipeline.config.params import TinyVerifierParams
    from eagle3_pipeline.verifier.tiny_kimi import build_kimi_like, save_kimi_like

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(seed)
    model = build_kimi_like(TinyVerifierParams.model_validate(KIMI_TINY), tokenizer).eval()
    out_dir.mkdir(parents=True, exist_ok=True)
    save_kimi_like(model, out_dir)  # and reads it back through transformers
    tokenizer.save_pretrained(out_dir)
    weights = out_dir / "model.safetensors"
    tensors: dict[str, Any] = {}
    for name, value in load_file(weights).items():
        if ROUTED_EXPERT.search(name):
            module = name.removesuffix(".weight")
            tensors |= {f"{module}.{k}": v for k, v in pack_int4(value).items()}
        else:
            tensors[name] = value.to(torch.bfloat16) if value.is_floating_point() else value
    save_file(tensors, weights, metadata={"format": "pt"})
    config_file = out_dir / "config.json"
    config = json.loads(config_file.read_text())
    config["quantization_config"] = KIMI_INT4
    config["dtype"] = config["text_config"]["dtype"] = "bfloat16"
    config_file.write_text(json.dumps(config, indent=2) + "\n")
    return {k: list(v.shape) for k, v in tensors.items()}
