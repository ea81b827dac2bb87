"""scripts/gpu_check_kimi_int4.py: the tiny INT4 Kimi-K2.5 the kimi/* checks serve, built on CPU."""

from __future__ import annotations

import json
from pathlib import Path

from scripts_loader import script_module

REPO = Path(__file__).resolve().parents[3]


kimi = script_module("gpu_check_kimi_int4")


def test_tiny_int4_kimi_builds_on_cpu_as_kimi_is_laid_out(tmp_path: Path) -> None:
    """The checkpoint kimi/generate serves: Kimi's wrapper and names, routed experts packed by
    compressed-tensors' own compressor (decompressed back within INT4's step), the config read
    by transformers and by vLLM's compressed-tensors config."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from safetensors.torch import load_file
    from transformers import AutoConfig
    from verifiers import build_tiny_dsv3_verifier
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
        CompressedTensorsConfig,
    )

    tokenizer_dir = build_tiny_dsv3_verifier(tmp_path / "tok", train_steps=0)
    out = tmp_path / "kimi-int4"
    shapes = kimi.build_tiny_kimi_int4(out, tokenizer_dir)
    config = AutoConfig.from_pretrained(out)
    text = config.text_config
    assert type(config).__name__ == "Kimi_K25Config" and text.model_type == "deepseek_v3"
    assert (text.hidden_size, text.moe_intermediate_size, text.qk_nope_head_dim) == (1024, 512, 128)
    assert (text.kv_lora_rank, text.qk_rope_head_dim) == (512, 64)
    name = "language_model.model.layers.1.mlp.experts.0.gate_proj"
    assert shapes[f"{name}.weight_packed"] == [512, 1024 // 8]  # 8 INT4 values per int32
    assert shapes[f"{name}.weight_scale"] == [512, 1024 // 32]  # one scale per group of 32
    assert f"{name}.weight" not in shapes
    down = "language_model.model.layers.2.mlp.experts.7.down_proj"
    assert shapes[f"{down}.weight_packed"] == [1024, 512 // 8]
    # Dense layer 0, shared experts and attention stay bf16, as Kimi's ignore list says.
    assert "language_model.model.layers.0.mlp.gate_proj.weight" in shapes
    assert "language_model.model.layers.1.mlp.shared_experts.up_proj.weight" in shapes
    assert "language_model.model.layers.1.self_attn.kv_b_proj.weight" in shapes
    tensors = load_file(out / "model.safetensors")
    assert tensors[f"{name}.weight_packed"].dtype.is_floating_point is False
    w = kimi.KIMI_INT4["config_groups"]["group_0"]["weights"]
    args = QuantizationArgs(
        **{k: w[k] for k in ("num_bits", "type", "symmetric", "strategy", "group_size")}
    )
    state = {k: tensors[f"{name}.{k}"] for k in ("weight_packed", "weight_scale", "weight_shape")}
    back = PackedQuantizationCompressor.decompress(
        state, QuantizationScheme(targets=["Linear"], weights=args)
    )
    assert back["weight"].shape == (512, 1024)
    quant = json.loads((out / "config.json").read_text())["quantization_config"]
    vllm_config = CompressedTensorsConfig.from_config(quant)
    assert vllm_config.get_name() == "compressed-tensors"
