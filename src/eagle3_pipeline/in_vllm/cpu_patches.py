"""Named, scoped patches that let vLLM 0.32 on CPU serve what this project serves.

`fix_cpu_rope_multihead`: every MLA model on CPU. vLLM's CPU rotary-embedding kernel
(`RotaryEmbedding.forward_cpu` -> `ops.rotary_embedding`) rotates only the first head of a 3-D
query `[tokens, heads, rope_dim]` and ignores the token stride of strided views; the MLA layer
(`model_executor/layers/mla.py`) hands it exactly that: `q[..., qk_nope_head_dim:]` of all
heads and `k_pe`, a slice of the fused kv_a output. So the rope half of q is unrotated for heads
1.., and k_pe rows land in the wrong tokens: logits nats away from transformers, and dependent
on how many tokens share the step (batching, verification of drafts vs one-token decode). The
fix rotates contiguous 2-D copies (which the kernel gets right) and writes them back in place.
Reproduced in tests/unit/in_vllm/test_cpu_patches.py (xfail on stock vLLM).

`pair_mla_drafter_block_size`: an MLA verifier (DeepSeek-V3, Kimi-K2.5) with a Llama-architecture
EAGLE-3 drafter. vLLM's CPU platform forces block size 16 for the CPU MLA kernel
(`platforms/cpu.py`), while the drafter's CPU_ATTN backend declares only `MultipleOf(32)`
(`v1/attention/backends/cpu_attn.py`), so the engine stops at start with `No common block size
for 16 (CPU_MLA: [16]; CPU_ATTN: [MultipleOf(32)])`. CPU_ATTN has a kernel for 16-token blocks
(`_get_attn_isa` picks "vec16" when the block size is no multiple of 32; the platform only
warns that it is slower), so 16 is added to what CPU_ATTN declares. Its outputs at 16 are
checked against torch SDPA in tests/unit/in_vllm/test_cpu_patches.py. On GPU both backends
share block sizes and nothing is patched.

vLLM's CPU platform spawns its engine and workers (the server forks its engine instead where it runs
the uni executor: `server_entry._fork_engine_core`); a spawned process loses a patch made in the
server process, so the server adds `--worker-extension-cls` naming a class of `cpu_mla_worker` (MLA)
or `mla_drafter_worker` (MLA + drafter), which vLLM imports in each worker before it builds the
model, and that import applies the patches. The in-process engine of extract calls
`patch_in_process`.

`inspect_models_in_process`: every server and engine on CPU. vLLM inspects a model class it has
not cached yet (`VLLM_CACHE_ROOT/modelinfos`) in a subprocess, only so that importing the model
cannot initialize CUDA in the server (`model_executor/models/registry.py`); that subprocess imports
torch and vLLM once more: 17 s of a 2-core server's start-up, once per architecture (verifier,
extraction model, drafter) in a fresh workspace. The CPU platform has no CUDA to protect, and the
process has both imported already, so the class is inspected in it; the result and the cache
file are the same.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from eagle3_pipeline.in_vllm import entry_points
from eagle3_pipeline.verifier import identity as vf

BLOCK_SIZE = 16  # the CPU MLA kernel's only block size (csrc/cpu/mla_decode.cpp)


def fix_cpu_rope_multihead() -> None:
    """Rotate query and key as contiguous `[tokens, heads * dim]` copies, then write back."""
    import torch
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    original = RotaryEmbedding.forward_cpu
    if getattr(original, "eagle3_patched", False):
        return

    def forward_cpu(self, positions, query, key=None):
        if query.dim() == 2 and query.is_contiguous() and (key is None or key.is_contiguous()):
            return original(self, positions, query, key)
        tokens = positions.numel()
        # clone, not contiguous(): a one-token view counts as contiguous and would alias
        flat_q = query.reshape(tokens, -1).clone(memory_format=torch.contiguous_format)
        flat_k = (
            None
            if key is None
            else key.reshape(tokens, -1).clone(memory_format=torch.contiguous_format)
        )
        original(self, positions, flat_q, flat_k)
        query.copy_(flat_q.view_as(query))
        if key is not None:
            key.copy_(flat_k.view_as(key))
        return query, key

    forward_cpu.eagle3_patched = True  # type: ignore[attr-defined]
    forward_cpu.eagle3_original = original  # type: ignore[attr-defined]
    RotaryEmbedding.forward_cpu = forward_cpu


def pair_mla_drafter_block_size() -> None:
    """Let CPU_ATTN (the drafter's attention) take 16-token blocks beside CPU_MLA."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    original = CPUAttentionBackend.get_supported_kernel_block_sizes
    if getattr(original, "eagle3_patched", False):
        return

    def with_mla_block(kv_cache_spec=None):
        sizes = list(original(kv_cache_spec))
        return sizes if BLOCK_SIZE in sizes else [BLOCK_SIZE, *sizes]

    with_mla_block.eagle3_patched = True  # type: ignore[attr-defined]
    CPUAttentionBackend.get_supported_kernel_block_sizes = staticmethod(with_mla_block)


def is_mla_config(config: dict) -> bool:
    """vLLM serves the model with MLA: DeepSeek-V2/V3 style latent attention (kv_lora_rank)."""
    return bool(vf.text_config(config).get("kv_lora_rank"))


def _server_args(args: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--model")
    parser.add_argument("--speculative-config")
    parser.add_argument("--worker-extension-cls")
    return parser.parse_known_args(args)[0]


def serves_mla_on_cpu(model: str | None, on_cpu: bool) -> bool:
    """CPU platform + a local MLA model directory (a hub id is never a tiny CPU verifier)."""
    if not (on_cpu and model and (Path(model) / "config.json").is_file()):
        return False
    return is_mla_config(vf.read_config(model))


def needs_mla_drafter_pairing(args: list[str], on_cpu: bool) -> bool:
    """CPU platform + a local MLA verifier (`--model`) + a drafter (`--speculative-config`)."""
    ns = _server_args(args)
    return bool(ns.speculative_config) and serves_mla_on_cpu(ns.model, on_cpu)


def patch_in_process(model: str, on_cpu: bool | None = None) -> None:
    """The patches for an engine that runs in this process (extract), where they apply."""
    on_cpu = on_cpu_platform() if on_cpu is None else on_cpu
    if on_cpu:
        inspect_models_in_process()
    if serves_mla_on_cpu(model, on_cpu):
        fix_cpu_rope_multihead()


def inspect_models_in_process() -> None:
    """On CPU: vLLM's model-class inspection in this process, not in a subprocess."""
    from vllm.model_executor.models import registry

    registry._run_in_subprocess = lambda fn: fn()


def on_cpu_platform() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def server_args_with_patches(args: list[str], on_cpu: bool | None = None) -> list[str]:
    """vLLM server `args`, plus the worker hook that applies the patches an MLA model on CPU
    needs (the block-size pairing only with a drafter).

    Also patches this process (cheap; the engine itself runs in spawned processes)."""
    on_cpu = on_cpu_platform() if on_cpu is None else on_cpu
    ns = _server_args(args)
    if not serves_mla_on_cpu(ns.model, on_cpu):
        return args
    fix_cpu_rope_multihead()
    worker = entry_points.MLA_WORKER
    if needs_mla_drafter_pairing(args, on_cpu):
        pair_mla_drafter_block_size()
        worker = entry_points.MLA_DRAFTER_WORKER
    if ns.worker_extension_cls:
        return args  # the user's own extension; its module must apply the patches itself
    return [*args, "--worker-extension-cls", worker]
