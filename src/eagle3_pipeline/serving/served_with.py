"""Which model runner and kernels vLLM chose, read from its server log.

vLLM picks them at start-up from the GPU, the model and what is installed (Model Runner V2 where
Triton exists, else V1; FlashInfer, FlashAttention, Triton or CPU attention; Marlin, Humming or
FlashInfer MoE kernels). Provenance records them for every stage that served the verifier, so a
run can be read afterwards; `make gpu-check` prints them.
"""

from __future__ import annotations

import os
import re
from pathlib import Path


def served_with(log_text: str) -> dict[str, str]:
    """The model runner and the backends vLLM chose, from its server log."""
    runner = "Model Runner V2"
    fallback = re.search(r"Model Runner V2 (requires|does not yet support) ([^;]*);", log_text)
    if fallback:
        runner = f"V1 (MRV2 {fallback[1]} {fallback[2]})"
    if os.environ.get("VLLM_USE_V2_MODEL_RUNNER") == "0":
        runner = "V1 (VLLM_USE_V2_MODEL_RUNNER=0)"
    attention = sorted(set(re.findall(r"Using (\w+) attention backend", log_text)))
    moe = sorted(set(re.findall(r"Using '?(\w+)'? (?:[\w-]+ )*?MoE backend", log_text)))
    fusion = re.search(r"""['"]?fuse_allreduce_rms['"]?\s*[:=]\s*(\w+)""", log_text)
    return {
        "runner": runner,
        "attention": ",".join(attention) or "not logged",
        "moe": ",".join(moe) or "not logged",
        "allreduce+rmsnorm fusion": fusion[1] if fusion else "not logged",
    }


def served_in(log_dir: Path, since: float = 0.0) -> dict[str, dict[str, str]]:
    """{log file name: what that server chose} for every vLLM server log in `log_dir` written
    since `since` (a timestamp: logs of earlier runs are not this run's)."""
    found = {}
    for log in sorted(log_dir.glob("*.log")) if log_dir.is_dir() else []:
        if log.stat().st_mtime < since:
            continue
        text = log.read_text(errors="replace")
        if "vLLM" in text or "vllm" in text:
            found[log.name] = served_with(text)
    return found
