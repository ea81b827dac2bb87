"""The verifier as vLLM loads it, built from its facts and params' `vllm` in one place for
every vLLM start.

generate and evaluate (with and without the drafter) serve `verifier_spec`; extract's in-process
engine takes `model_args`, which the spec is made of. So a pinned hub revision, remote code and
text-only loading of multimodal wrappers (Kimi-K2.5) reach every start alike: a stage that
built its own spec once served another revision than the one its data came from.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eagle3_pipeline.config.params import VllmParams
from eagle3_pipeline.serving.server import ServerSpec
from eagle3_pipeline.verifier.identity import VerifierFacts

SERVED_NAME = "verifier"
_VLLM_DTYPES = {"float32", "bfloat16", "float16"}


def engine_dtype(verifier: VerifierFacts) -> str:
    """The verifier's own dtype, as the hf backend loads it.

    vLLM's "auto" downcasts a float32 checkpoint to bf16; the two backends would then compute
    different tensors (they must agree: tests/integration/test_extract_vllm.py).
    """
    dtype = str(verifier.declared_dtype or "auto")
    return dtype if dtype in _VLLM_DTYPES else "auto"


def model_args(verifier: VerifierFacts, v: VllmParams, dtype: str | None = None) -> dict[str, Any]:
    """What vLLM loads and how, under vllm.LLM's argument names (also ServerSpec's fields).

    `dtype` None leaves vLLM's default ("auto": bf16 for a float32 checkpoint).
    """
    return {
        "model": verifier.path,
        "revision": verifier.revision,
        "trust_remote_code": verifier.trust_remote_code,
        "language_model_only": verifier.multimodal,
        "dtype": dtype,
        "max_model_len": v.max_model_len,
        "enforce_eager": v.enforce_eager,
        "tensor_parallel_size": v.tensor_parallel_size,
    }


def verifier_spec(
    verifier: VerifierFacts,
    v: VllmParams,
    log_file: Path,
    *,
    reasoning_parser: str | None = None,
    dtype: str | None = None,
) -> ServerSpec:
    """The verifier served as `verifier` with params' `vllm` (extra_args passed verbatim)."""
    return ServerSpec(
        **model_args(verifier, v, dtype),
        log_file=log_file,
        reasoning_parser=reasoning_parser,
        served_model_name=SERVED_NAME,
        ready_timeout_s=v.ready_timeout_s,
        extra_args=list(v.extra_args),
    )
