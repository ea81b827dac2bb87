"""GPU memory, from config files alone: the verifier's weights and KV cache under vLLM (how many
requests of prompt + generate.max_new_tokens fit at once), and the drafter's training per rank.

Estimates, not measurements: vLLM logs its measured "Available KV cache memory" at start-up and
`make gpu-check` prints the peak of a training step; these numbers say whether a profile can fit
before anything is downloaded.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3_pipeline.config.params import Params
from eagle3_pipeline.drafter.shape import DrafterShape, ParamGroup
from eagle3_pipeline.verifier import identity as vf

GIB = 1 << 30
# vLLM 0.32's default (config/cache.py CacheConfig.gpu_memory_utilization).
VLLM_GPU_MEMORY_UTILIZATION = 0.92
# What vLLM holds besides weights and KV cache: activations of a max_num_batched_tokens step,
# CUDA graphs, NCCL and sampler buffers. A rough allowance, not vLLM's own profile.
RUNTIME_RESERVE_BYTES = 8 * GIB
# Training activations per logit (tokens x draft vocab x TTT step): bf16 logits, the fp32
# log-softmax kept for backward and the fp32 target distribution.
LOGIT_BYTES = 2 + 4 + 4


@dataclass(frozen=True)
class Weights:
    bytes: int
    how: str


def _extra_arg(params: Params, flag: str) -> str | None:
    """The value of `flag` in vllm.extra_args (`--flag value` or `--flag=value`), if given."""
    args = params.vllm.extra_args
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def gpu_memory_utilization(params: Params) -> float:
    given = _extra_arg(params, "--gpu-memory-utilization")
    return float(given) if given is not None else VLLM_GPU_MEMORY_UTILIZATION


def kv_cache_value_bytes(params: Params) -> int:
    dtype = _extra_arg(params, "--kv-cache-dtype") or "auto"
    return 1 if dtype.startswith("fp8") else 2


def kv_bytes_per_token(config: dict[str, Any], tp: int, value_bytes: int) -> tuple[int, str]:
    """(KV-cache bytes per token on one GPU, how). MLA caches one latent of kv_lora_rank +
    qk_rope_head_dim per layer, the same on every TP rank; other attention caches K and V of
    the rank's kv heads (at least one: vLLM replicates heads when TP exceeds them)."""
    tc = vf.text_config(config)
    layers = int(tc["num_hidden_layers"])
    if tc.get("kv_lora_rank"):
        width = int(tc["kv_lora_rank"]) + int(tc.get("qk_rope_head_dim") or 0)
        how = f"MLA: {layers} layers x ({tc['kv_lora_rank']} + {tc.get('qk_rope_head_dim')})"
        return layers * width * value_bytes, f"{how} x {value_bytes} B, on every TP rank"
    heads = int(tc.get("num_key_value_heads") or tc["num_attention_heads"])
    head_dim = int(tc.get("head_dim") or tc["hidden_size"] // tc["num_attention_heads"])
    per_rank = max(1, heads // tp)
    how = f"K+V: 2 x {layers} layers x {per_rank} kv heads x {head_dim} x {value_bytes} B per rank"
    return 2 * layers * per_rank * head_dim * value_bytes, how


def _linears(tc: dict[str, Any]) -> list[tuple[str, int]]:
    """(a module name as checkpoints spell it, parameter count) of every projection of the text
    model; the name is matched against a quantization config's `ignore` patterns."""
    h, layers = int(tc["hidden_size"]), int(tc["num_hidden_layers"])
    heads = int(tc["num_attention_heads"])
    out: list[tuple[str, int]] = []
    for i in range(layers):
        p = f"model.layers.{i}."
        if tc.get("kv_lora_rank"):
            nope, rope = int(tc["qk_nope_head_dim"]), int(tc["qk_rope_head_dim"])
            kvr, v_dim = int(tc["kv_lora_rank"]), int(tc["v_head_dim"])
            q_out = heads * (nope + rope)
            if tc.get("q_lora_rank"):
                qr = int(tc["q_lora_rank"])
                out += [(p + "self_attn.q_a_proj", h * qr), (p + "self_attn.q_b_proj", qr * q_out)]
            else:
                out.append((p + "self_attn.q_proj", h * q_out))
            out += [
                (p + "self_attn.kv_a_proj_with_mqa", h * (kvr + rope)),
                (p + "self_attn.kv_b_proj", kvr * heads * (nope + v_dim)),
                (p + "self_attn.o_proj", heads * v_dim * h),
            ]
        else:
            hd = int(tc.get("head_dim") or h // heads)
            kv = int(tc.get("num_key_value_heads") or heads)
            out += [
                (p + "self_attn.q_proj", h * heads * hd),
                (p + "self_attn.k_proj", h * kv * hd),
                (p + "self_attn.v_proj", h * kv * hd),
                (p + "self_attn.o_proj", heads * hd * h),
            ]
        experts = int(tc.get("n_routed_experts") or 0)
        if experts and i >= int(tc.get("first_k_dense_replace") or 0):
            mi = int(tc["moe_intermediate_size"])
            out.append((p + "mlp.experts.0.gate_proj", experts * 3 * h * mi))
            shared = int(tc.get("n_shared_experts") or 0)
            if shared:
                out.append((p + "mlp.shared_experts.gate_proj", shared * 3 * h * mi))
        else:
            out.append((p + "mlp.gate_proj", 3 * h * int(tc["intermediate_size"])))
    return out


def _ignored(name: str, ignore: list[str]) -> bool:
    """compressed-tensors' matching: `re:` patterns by re.match, others by exact name."""
    return any(re.match(pat[3:], name) if pat.startswith("re:") else pat == name for pat in ignore)


def _quantized_bytes(q: dict[str, Any]) -> tuple[float, str] | None:
    """Bytes per weight of a quantization config's Linear layers, if this plan knows it."""
    if q.get("quant_method") == "compressed-tensors":
        groups = [g.get("weights") or {} for g in (q.get("config_groups") or {}).values()]
        if len(groups) == 1 and groups[0].get("num_bits") and groups[0].get("group_size"):
            w = groups[0]
            bits, group = int(w["num_bits"]), int(w["group_size"])
            per = bits / 8 + 2 / group + (0 if w.get("symmetric", True) else bits / 8 / group)
            return per, f"int{bits} group {group} ({per:.4g} B/weight with bf16 scales)"
    if q.get("quant_method") == "fp8":
        block = q.get("weight_block_size") or [128, 128]
        return 1 + 4 / (block[0] * block[1]), f"fp8 blocks {block[0]}x{block[1]}"
    return None


def weight_bytes(config: dict[str, Any], config_file: Path | None) -> Weights:
    """The verifier's weights: the checkpoint index's total_size beside config.json when there,
    else counted from the text config (projections, embeddings, lm_head; norms and any vision
    tower left out) with its quantization config applied."""
    index = config_file.parent / "model.safetensors.index.json" if config_file else None
    if index is not None and index.is_file():
        total = (json.loads(index.read_text()).get("metadata") or {}).get("total_size")
        if isinstance(total, int):
            return Weights(total, f"{index.name} total_size")
    tc = vf.text_config(config)
    q = config.get("quantization_config") or tc.get("quantization_config") or {}
    quant = _quantized_bytes(q) if q else None
    ignore = list(q.get("ignore") or [])
    linears = _linears(tc)
    plain = sum(n for name, n in linears if quant is None or _ignored(name, ignore))
    packed = sum(n for name, n in linears if quant is not None and not _ignored(name, ignore))
    vocab = int(tc["vocab_size"]) * int(tc["hidden_size"])
    plain += vocab * (1 if tc.get("tie_word_embeddings") else 2)
    total = plain * 2 + (round(packed * quant[0]) if quant else 0)
    how = f"from config: {plain / 1e9:,.1f}B bf16 params"
    if quant:
        how += f" + {packed / 1e9:,.1f}B {quant[1]}"
    elif q:
        how += f" (quantization {q.get('quant_method')!r} not counted: bf16 assumed)"
    return Weights(total, how)


@dataclass(frozen=True)
class ServingMemory:
    """One GPU of the vLLM verifier: weights, KV cache, and how many full requests fit."""

    gpu_bytes: int
    utilization: float
    weights: Weights
    tp: int
    kv_bytes_per_token: int
    kv_how: str
    kv_room_bytes: int
    request_tokens: int  # prompt + generate.max_new_tokens, at most vllm.max_model_len
    concurrency: int  # generate.concurrency

    @property
    def weights_per_gpu(self) -> int:
        return self.weights.bytes // self.tp

    @property
    def kv_tokens(self) -> int:
        return max(0, self.kv_room_bytes) // self.kv_bytes_per_token

    @property
    def max_concurrency(self) -> int:
        return self.kv_tokens // self.request_tokens


def serving_memory(
    params: Params, config: dict[str, Any], config_file: Path | None, prompt_tokens: int
) -> ServingMemory | None:
    """None when the profile names no GPU memory (vllm.gpu_memory_gib) or does not use vLLM."""
    gib = params.vllm.gpu_memory_gib
    if gib is None or "vllm" not in (params.generate.backend, params.extract.backend):
        return None
    tp = params.vllm.tensor_parallel_size
    util = gpu_memory_utilization(params)
    weights = weight_bytes(config, config_file)
    per_token, how = kv_bytes_per_token(config, tp, kv_cache_value_bytes(params))
    gpu = round(gib * GIB)
    room = round(gpu * util) - weights.bytes // tp - RUNTIME_RESERVE_BYTES
    return ServingMemory(
        gpu_bytes=gpu,
        utilization=util,
        weights=weights,
        tp=tp,
        kv_bytes_per_token=per_token,
        kv_how=how,
        kv_room_bytes=room,
        # vLLM caps an answer at max_model_len - prompt.
        request_tokens=min(
            prompt_tokens + params.generate.max_new_tokens, params.vllm.max_model_len
        ),
        concurrency=params.generate.concurrency,
    )


@dataclass(frozen=True)
class TrainMemory:
    """One training rank: fp32 master weights, grads, DDP buckets, AdamW, and the logits."""

    nproc: int
    strategy: str
    parts: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.parts.values())


def train_memory(params: Params, groups: list[ParamGroup], d: DrafterShape) -> TrainMemory:
    """speculators keeps master weights in fp32 and runs the step under bf16 autocast; DDP
    adds a bucket copy of the gradients; FSDP2 shards weights, gradients and AdamW states over
    the ranks. Activations are dominated by the logits of every TTT step."""
    t = params.train
    total = sum(g.count for g in groups)
    trainable = sum(g.count for g in groups if g.trainable)
    ranks = t.nproc * params.cluster.training_nodes  # every node's ranks share one FSDP mesh
    shards = ranks if t.strategy == "fsdp" and ranks > 1 else 1
    parts = {
        "weights fp32": total * 4 // shards,
        "grads fp32": trainable * 4 // shards,
        "AdamW fp32": trainable * 8 // shards,
    }
    if ranks > 1 and t.strategy == "ddp":
        parts["DDP buckets"] = trainable * 4
    parts["logits"] = t.max_tokens_per_batch * d.draft_vocab_size * t.ttt_steps * LOGIT_BYTES
    return TrainMemory(ranks, t.strategy, parts)
