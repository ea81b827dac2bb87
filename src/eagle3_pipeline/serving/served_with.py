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

from eagle3_pipeline.core.errors import ServerError
from eagle3_pipeline.core.progress import log


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
    for path in sorted(log_dir.glob("*.log")) if log_dir.is_dir() else []:
        if path.stat().st_mtime < since:
            continue
        text = path.read_text(errors="replace")
        if "vLLM" in text or "vllm" in text:
            found[path.name] = served_with(text)
    return found


# vLLM 0.32 logs the verifier layers it captures for the drafter: V1 "Using auxiliary layers from
# speculative config: (2, 4, 5)", V2 "Using Eagle3 auxiliary layers from config|model: (...)".
_AUX_LAYERS = re.compile(
    r"Using (?:Eagle3 )?auxiliary layers from (speculative config|config|model): \(([\d,\s]*)\)"
)


def aux_layers(log_text: str) -> tuple[str, list[int]] | None:
    """(where vLLM took them from: config or model default, the layer ids) of the last server
    start in the log; None when it logged none (V1 logs nothing for the model's defaults)."""
    found = _AUX_LAYERS.findall(log_text)
    if not found:
        return None
    source, ids = found[-1]
    return ("model" if source == "model" else "config"), [
        int(i) for i in ids.split(",") if i.strip()
    ]


def check_aux_layers(
    log_file: Path, trained: list[int], drafter_dir: Path, stage: str
) -> list[int] | None:
    """The verifier layers vLLM captured for the drafter, from its log; refuse any but those
    the drafter was trained on (the off-by-one that reads as a drafter that learned little)."""
    text = log_file.read_text(errors="replace") if log_file.is_file() else ""
    found = aux_layers(text)
    if found is None:
        log(stage, f"{log_file}: vLLM logged no auxiliary layers: served layers not checked")
        return None
    source, ids = found
    if source == "model" or ids != list(trained):
        raise ServerError(
            f"{log_file}: vLLM captured verifier layers {ids} (from the {source}) for "
            f"{drafter_dir}, trained on {list(trained)}: its acceptance measures other "
            f"features; check the aux layer ids in {drafter_dir}/config.json"
        )
    log(stage, f"vLLM captured the layers the drafter was trained on: {ids}")
    return ids
