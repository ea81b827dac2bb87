"""The CPU patches for MLA models: where they apply; the rope defect they fix, reproduced on
stock vLLM; and that the CPU attention kernel the block-size pairing unlocks (16-token blocks,
ISA "vec16") computes the drafter's attention correctly.

The kernel test runs vLLM's own CPU_ATTN backend (`CPUAttentionBackendImpl.do_kv_cache_update`
and `.forward`, the calls the drafter's attention layer makes) on paged KV caches with scattered
blocks, for the three shapes a drafter sees: prefill of several sequences, a multi-token step
on top of a cache (EAGLE's draft steps and verification), and one-token decode; the reference
is torch SDPA on the same q/k/v. Block 32 (the backend's own "vec" path) is the control.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
from builders import fake_verifier

from eagle3_pipeline.in_vllm import cpu_patches, entry_points

SPEC = '{"method": "eagle3", "model": "models/drafter", "num_speculative_tokens": 3}'


def _model(root: Path, text: dict) -> str:
    config = {"architectures": ["KimiK25ForConditionalGeneration"], "text_config": text}
    return str(fake_verifier(root, config))


@pytest.fixture
def mla(tmp_path: Path) -> str:
    return _model(tmp_path / "mla", {"num_hidden_layers": 4, "kv_lora_rank": 512})


@pytest.fixture
def llama(tmp_path: Path) -> str:
    return _model(tmp_path / "llama", {"num_hidden_layers": 8, "num_key_value_heads": 2})


def test_patches_only_for_mla_on_cpu_pairing_only_with_drafter(mla: str, llama: str) -> None:
    assert cpu_patches.serves_mla_on_cpu(mla, on_cpu=True)
    assert not cpu_patches.serves_mla_on_cpu(mla, on_cpu=False)
    assert not cpu_patches.serves_mla_on_cpu(llama, on_cpu=True)
    need = cpu_patches.needs_mla_drafter_pairing
    assert need(["--model", mla, "--speculative-config", SPEC], on_cpu=True)
    assert not need(["--model", mla, "--speculative-config", SPEC], on_cpu=False)  # GPU
    assert not need(["--model", mla], on_cpu=True)  # no drafter: the baseline server
    assert not need(["--model", llama, "--speculative-config", SPEC], on_cpu=True)
    assert not need(["--model", "org/hub-model", "--speculative-config", SPEC], on_cpu=True)


def test_server_args_gain_the_worker_hook_only_when_needed(
    mla: str, llama: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    patched: list[str] = []
    monkeypatch.setattr(cpu_patches, "pair_mla_drafter_block_size", lambda: patched.append("pair"))
    monkeypatch.setattr(cpu_patches, "fix_cpu_rope_multihead", lambda: patched.append("rope"))
    plain = ["--model", llama, "--speculative-config", SPEC]
    assert cpu_patches.server_args_with_patches(plain, on_cpu=True) == plain
    assert cpu_patches.server_args_with_patches(plain[:2], on_cpu=False) == plain[:2]
    assert patched == []
    baseline = ["--model", mla, "--port", "1"]
    got = cpu_patches.server_args_with_patches(baseline, on_cpu=True)
    assert got == [*baseline, "--worker-extension-cls", entry_points.MLA_WORKER]
    assert patched == ["rope"]
    args = ["--model", mla, "--speculative-config", SPEC, "--port", "1"]
    got = cpu_patches.server_args_with_patches(args, on_cpu=True)
    assert got == [*args, "--worker-extension-cls", entry_points.MLA_DRAFTER_WORKER]
    assert patched == ["rope", "rope", "pair"]
    for qualname in (entry_points.MLA_WORKER, entry_points.MLA_DRAFTER_WORKER):
        module = qualname.rpartition(".")[0].rpartition(".")[2]
        assert (Path(cpu_patches.__file__).parent / f"{module}.py").is_file()


# --- vLLM's CPU rotary embedding on the MLA layer's tensors ----------------------------------

N_TOKENS, MLA_HEADS, NOPE, ROPE, LORA = 7, 4, 32, 64, 512


def _rope_case(n_tokens: int = N_TOKENS):
    """A CPU RotaryEmbedding as DeepSeek builds it, the MLA layer's q and fused kv_a output, and
    the interleaved rotation of their rope parts computed here."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(
            ROPE,
            max_position=2048,
            rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
            is_neox_style=False,  # DeepSeek's interleaved pairs, as vLLM's deepseek_v2 asks
            dtype=torch.float32,
        )
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(n_tokens, MLA_HEADS, NOPE + ROPE, generator=gen)
    kv = torch.randn(n_tokens, LORA + ROPE, generator=gen)
    positions = torch.arange(n_tokens) + 3
    inv = 1.0 / (10000 ** (torch.arange(0, ROPE, 2).float() / ROPE))
    angle = positions.float()[:, None, None] * inv

    def rotate(x: torch.Tensor) -> torch.Tensor:
        even, odd = x[..., 0::2], x[..., 1::2]
        out = torch.empty_like(x)
        out[..., 0::2] = even * angle.cos() - odd * angle.sin()
        out[..., 1::2] = even * angle.sin() + odd * angle.cos()
        return out

    want = rotate(q[..., NOPE:].clone()), rotate(kv[:, LORA:].unsqueeze(1).clone())
    return rope, positions, q, kv, want


def _rotate_as_mla_does(rope, positions, q, kv, stock: bool = False):
    """model_executor/layers/mla.py: rope on views of q (all heads) and of the kv_a output.
    `stock`: vLLM's own forward_cpu even where this process applied the patch (extract does)."""
    forward = type(rope).forward_cpu
    forward = getattr(forward, "eagle3_original", forward) if stock else forward
    k_pe = kv[:, LORA:].unsqueeze(1)
    q[..., NOPE:], k_pe = forward(rope, positions, q[..., NOPE:], k_pe)
    return q[..., NOPE:], k_pe


@pytest.mark.vllm
@pytest.mark.xfail(
    strict=True,
    reason="vLLM 0.32 CPU defect: ops.rotary_embedding rotates only the first head of a 3-D "
    "query and ignores the token stride of strided views, which is how the MLA layer calls it "
    "(fixed by cpu_patches.fix_cpu_rope_multihead)",
)
def test_stock_cpu_rope_on_mla_tensors_matches_reference() -> None:
    rope, positions, q, kv, (want_q, want_k) = _rope_case()
    got_q, got_k = _rotate_as_mla_does(rope, positions, q, kv, stock=True)
    torch.testing.assert_close(got_k, want_k)
    torch.testing.assert_close(got_q, want_q)


@pytest.mark.vllm
@pytest.mark.parametrize("n_tokens", [N_TOKENS, 1])  # a prefill or verify step; one-token decode
def test_patched_cpu_rope_matches_reference_in_place(n_tokens: int) -> None:
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    original = RotaryEmbedding.forward_cpu
    try:
        cpu_patches.fix_cpu_rope_multihead()
        cpu_patches.fix_cpu_rope_multihead()  # idempotent
        rope, positions, q, kv, (want_q, want_k) = _rope_case(n_tokens)
        nope, latent = q[..., :NOPE].clone(), kv[:, :LORA].clone()
        got_q, got_k = _rotate_as_mla_does(rope, positions, q, kv)
        torch.testing.assert_close(got_q, want_q, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got_k, want_k, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(kv[:, LORA:].unsqueeze(1), want_k, rtol=1e-5, atol=1e-5)
        assert torch.equal(q[..., :NOPE], nope) and torch.equal(kv[:, :LORA], latent)
        # a Llama-style contiguous 2-D call is passed through unchanged
        flat_q, flat_k = want_q.reshape(n_tokens, -1).clone(), want_k.reshape(n_tokens, -1).clone()
        ref_q, ref_k = flat_q.clone(), flat_k.clone()
        original(rope, positions, ref_q, ref_k)
        rope.forward_cpu(positions, flat_q, flat_k)
        assert torch.equal(flat_q, ref_q) and torch.equal(flat_k, ref_k)
    finally:
        RotaryEmbedding.forward_cpu = original


# --- vLLM's CPU attention at the paired block size ------------------------------------------

HEADS, KV_HEADS, HEAD_DIM = 4, 4, 32  # the tiny-dsv3 drafter: hidden 128, 4 heads
# (query tokens, tokens already cached) per request, one batch each
CASES = {
    "prefill": [(37, 0), (21, 0), (5, 0)],
    "multi_token_step": [(4, 30), (4, 17)],
    "decode": [(1, 45), (1, 16), (1, 3)],
}


class _Layer:
    """What the backend reads from an attention layer: the ISA and the KV scales."""

    def __init__(self, isa: str) -> None:
        self.isa = isa
        self._k_scale_float = 1.0
        self._v_scale_float = 1.0


def _reference(q, k, v, n_query: int, n_cached: int) -> torch.Tensor:
    """SDPA over the whole sequence; each query token at position n_cached + i sees 0..itself."""
    total = n_cached + n_query
    mask = torch.ones(n_query, total, dtype=torch.bool).tril(diagonal=n_cached)
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1).float(),
        k.transpose(0, 1).float(),
        v.transpose(0, 1).float(),
        attn_mask=mask,
        scale=HEAD_DIM**-0.5,
    )
    return out.transpose(0, 1)


def _run_backend(block_size: int, dtype: torch.dtype, case: list[tuple[int, int]]):
    """vLLM's CPU_ATTN on a batch; (outputs per request, SDPA references per request)."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends import cpu_attn

    gen = torch.Generator().manual_seed(block_size)
    isa = cpu_attn._get_attn_isa(dtype, block_size, HEAD_DIM, "auto")
    num_blocks = 64
    kv_cache = torch.zeros(num_blocks, KV_HEADS, block_size, 2 * HEAD_DIM, dtype=dtype)
    free = torch.randperm(num_blocks, generator=gen).tolist()  # scattered, as a pool hands out
    max_blocks = max((c + n + block_size - 1) // block_size for n, c in case)
    block_table = torch.zeros(len(case), max_blocks, dtype=torch.int32)
    # The impl reads only the model dtype from the engine's config (its zentorch choice).
    engine = SimpleNamespace(model_config=SimpleNamespace(dtype=dtype))
    with mock.patch.object(cpu_attn, "get_current_vllm_config", lambda: engine):
        impl = cpu_attn.CPUAttentionBackendImpl(
            HEADS, HEAD_DIM, HEAD_DIM**-0.5, KV_HEADS, None, None, "auto"
        )
    layer = _Layer(isa)
    qs, ks, vs, refs, slots_now = [], [], [], [], []
    for r, (n_query, n_cached) in enumerate(case):
        total = n_query + n_cached
        for b in range((total + block_size - 1) // block_size):
            block_table[r, b] = free.pop()
        q = torch.randn(n_query, HEADS, HEAD_DIM, generator=gen).to(dtype)
        k = torch.randn(total, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
        v = torch.randn(total, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
        slots = torch.tensor(
            [
                int(block_table[r, p // block_size]) * block_size + p % block_size
                for p in range(total)
            ]
        )
        if n_cached:  # earlier steps wrote these
            impl.do_kv_cache_update(layer, k[:n_cached], v[:n_cached], kv_cache, slots[:n_cached])
        qs.append(q)
        ks.append(k[n_cached:])
        vs.append(v[n_cached:])
        slots_now.append(slots[n_cached:])
        refs.append(_reference(q, k, v, n_query, n_cached))
    query, key, value = torch.cat(qs), torch.cat(ks), torch.cat(vs)
    slot_mapping = torch.cat(slots_now)
    impl.do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
    n_queries = torch.tensor([n for n, _ in case], dtype=torch.int32)
    query_start_loc = torch.cat([torch.zeros(1, dtype=torch.int32), n_queries.cumsum(0)]).int()
    seq_lens = torch.tensor([n + c for n, c in case], dtype=torch.int32)
    metadata = cpu_attn.CPUAttentionMetadata(
        num_actual_tokens=len(query),
        max_query_len=int(n_queries.max()),
        query_start_loc=query_start_loc,
        max_seq_len=int(seq_lens.max()),
        seq_lens=seq_lens,
        block_table=block_table,
        slot_mapping=slot_mapping,
        scheduler_metadata=ops.cpu_attn_get_scheduler_metadata(
            num_reqs=len(case),
            num_heads=HEADS,
            num_kv_heads=KV_HEADS,
            head_dim=HEAD_DIM,
            seq_lens=seq_lens,
            dtype=dtype,
            query_start_loc=query_start_loc,
            causal=True,
            sliding_window_size=-1,
            isa=isa,
            enable_kv_split=False,
        ),
        causal=True,
    )
    output = torch.empty_like(query)
    impl.forward(layer, query, key, value, kv_cache, metadata, output)
    outs = list(output.split(n_queries.tolist()))
    return isa, outs, refs


@pytest.mark.vllm
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize(
    ("block_size", "dtype", "isa", "atol"),
    [
        (16, torch.float32, "vec16", 1e-5),  # what the pairing uses (tiny-dsv3 serves fp32)
        (16, torch.bfloat16, "vec16", 2e-2),
        (32, torch.float32, "vec", 1e-5),  # the backend's own block size: the control
    ],
)
def test_cpu_attention_matches_sdpa(case, block_size, dtype, isa, atol) -> None:
    got_isa, outs, refs = _run_backend(block_size, dtype, CASES[case])
    assert got_isa == isa
    for r, (out, ref) in enumerate(zip(outs, refs, strict=True)):
        torch.testing.assert_close(out.float(), ref, atol=atol, rtol=0, msg=f"request {r}")


@pytest.mark.vllm
def test_patch_declares_block_16_beside_cpu_mla() -> None:
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend
    from vllm.v1.worker.utils import select_common_block_size

    original = CPUAttentionBackend.get_supported_kernel_block_sizes
    try:
        with pytest.raises(ValueError, match="No common block size for 16"):
            select_common_block_size(16, [CPUMLABackend, CPUAttentionBackend])
        cpu_patches.pair_mla_drafter_block_size()
        cpu_patches.pair_mla_drafter_block_size()  # idempotent
        assert select_common_block_size(16, [CPUMLABackend, CPUAttentionBackend]) == 16
        assert CPUAttentionBackend.get_supported_kernel_block_sizes()[0] == 16
        assert select_common_block_size(128, [CPUAttentionBackend]) == 128  # unchanged
    finally:
        CPUAttentionBackend.get_supported_kernel_block_sizes = staticmethod(original)
