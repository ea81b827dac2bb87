"""`eagle3 plan`'s GPU memory: vLLM's KV room and the concurrency it holds, training per rank,
and the generated tokens tokenize would throw away, on the Kimi-K2.5 fixture config."""

from __future__ import annotations

import json

import pytest
from plan_cases import AQ_MEDAI, KIMI, PROFILE, kimi_plan

from eagle3_pipeline.config.params import load_params
from eagle3_pipeline.plan import checks, memory, plan, report


def test_kimi_kv_cache_and_weights_from_its_config() -> None:
    config = json.loads(KIMI.read_text())
    per_token, how = memory.kv_bytes_per_token(config, tp=8, value_bytes=2)
    assert per_token == 61 * (512 + 64) * 2 == 70_272  # MLA latent, on every TP rank
    assert "MLA" in how
    weights = memory.weight_bytes(config, KIMI)
    # Routed experts int4 group 32 (0.5625 B/weight), everything else bf16: ~594 GB (553 GiB).
    assert 585e9 < weights.bytes < 600e9
    assert "int4 group 32" in weights.how


def test_kimi_profile_concurrency_fits_its_kv_cache() -> None:
    p = kimi_plan()
    s = p.serving
    assert s is not None and s.tp == 8 and s.utilization == memory.VLLM_GPU_MEMORY_UTILIZATION
    assert 72e9 < s.weights_per_gpu < 76e9
    # 139 GiB x 0.92 - weights / 8 - runtime reserve, in tokens of 70,272 B.
    room = round(139 * 2**30 * 0.92) - s.weights.bytes // 8 - memory.RUNTIME_RESERVE_BYTES
    assert s.kv_room_bytes == room and s.kv_tokens == room // 70_272
    assert s.request_tokens == 256 + 16384  # assumed prompt (no prompt files here) + new
    assert s.concurrency <= s.max_concurrency
    # Even a full vllm.max_model_len per request fits the profile's concurrency.
    assert s.kv_tokens // 20480 >= s.concurrency
    text = report.render(p)
    assert "KV 70,272 B/token" in text and f"= {s.max_concurrency} at once" in text
    assert "warning" not in text


def test_too_many_concurrent_requests_warn() -> None:
    params = load_params(PROFILE).model_copy(deep=True)
    params.generate.concurrency = 64
    p = plan.make_plan(params, PROFILE, KIMI, AQ_MEDAI)
    assert p.serving is not None and p.serving.max_concurrency < 64
    assert any(
        w.startswith("generate.concurrency 64 x 16,640 tokens")
        and f"set generate.concurrency <= {p.serving.max_concurrency}" in w
        for w in p.warnings
    )
    params.vllm.gpu_memory_gib = 80  # H100: the weights alone nearly fill it
    p = plan.make_plan(params, PROFILE, KIMI, AQ_MEDAI)
    assert any("leave no KV cache" in w for w in p.warnings)
    params.vllm.gpu_memory_gib = None
    p = plan.make_plan(params, PROFILE, KIMI, AQ_MEDAI)
    assert p.serving is None and "not estimated (set vllm.gpu_memory_gib)" in report.render(p)


def test_generated_tokens_cut_by_tokenize_warn() -> None:
    params = load_params(PROFILE).model_copy(deep=True)
    params.tokenize.max_seq_len = 8192
    (warning,) = checks.sequence_warnings(params, 256)
    assert "a sample reaches 16,640 tokens" in warning
    assert "up to 8,448 generated tokens per sample are thrown away" in warning
    # vLLM caps an answer at max_model_len - prompt: that bounds what tokenize sees.
    params.vllm.max_model_len = 8192
    assert checks.sequence_warnings(params, 256) == []
    assert checks.sequence_warnings(load_params(PROFILE), 4096) == []  # the profile's room


@pytest.mark.parametrize(("strategy", "low", "high"), [("ddp", 40e9, 55e9), ("fsdp", 20e9, 26e9)])
def test_training_memory_per_rank(strategy: str, low: float, high: float) -> None:
    params = load_params(PROFILE).model_copy(deep=True)
    params.train.strategy = strategy
    p = plan.make_plan(params, PROFILE, KIMI, AQ_MEDAI)
    t = p.training
    assert t.nproc == 8 and low < t.total < high, t.parts
    # 20,480 tokens x 32,000 draft vocab x 3 TTT steps x 10 B.
    assert t.parts["logits"] == 20480 * 32000 * 3 * memory.LOGIT_BYTES
    shards = 8 if strategy == "fsdp" else 1
    assert t.parts["AdamW fp32"] == p.trainable_params * 8 // shards
    assert ("DDP buckets" in t.parts) is (strategy == "ddp")
    assert f"per rank (8 x {strategy})" in report.render(p)
