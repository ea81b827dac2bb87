"""vLLM serves stage `export`'s flat export like the speculators one, SpecForge's wiring too
(what export writes and refuses: tests/unit/stages/test_export.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from export_repo import SPECFORGE_FLAGS, K, make_repo, params, run_export

VLLM_SCRIPT = textwrap.dedent(
    """
    import gc, json, os, sys
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    verifier, out, drafters = sys.argv[1], sys.argv[2], sys.argv[3:]
    prompts = [[1 + (7 * i + j) % 500 for j in range(12)] for i in range(6)]
    sampling = SamplingParams(max_tokens=32, temperature=0.0)
    names = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
             "vllm:spec_decode_num_accepted_tokens",
             "vllm:spec_decode_num_accepted_tokens_per_pos")
    result = {}
    for drafter in [None, *drafters]:  # one process: vLLM is imported once for all of them
        spec = None if drafter is None else {
            "method": "eagle3", "model": drafter, "num_speculative_tokens": NUM_SPEC}
        llm = LLM(model=verifier, dtype="float32", enforce_eager=True, max_model_len=256,
                  speculative_config=spec, disable_log_stats=False, seed=0)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sampling, use_tqdm=False)
        counters = {}
        for m in llm.get_metrics():
            if m.name in names:
                counters[m.name] = list(getattr(m, "values", None) or [m.value])
        result[drafter or "baseline"] = {
            "tokens": [list(o.outputs[0].token_ids) for o in outs], "counters": counters}
        del llm
        gc.collect()
    with open(out, "w") as f:
        json.dump(result, f)
    """
).replace("NUM_SPEC", str(K))


EXPORTS = {  # the two wirings, each exported in both formats
    "speculators": {},
    "specforge": SPECFORGE_FLAGS,
}


@pytest.fixture(scope="module")
def served(tiny_verifier_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """vLLM in one subprocess, one in-process engine at a time: the baseline, then each wiring's
    speculators and flat exports as drafters. {wiring: {format: run}} and the baseline's run."""
    tmp = tmp_path_factory.mktemp("exports")
    drafters = {}
    for wiring, flags in EXPORTS.items():
        root = make_repo(tmp / wiring / "repo", tiny_verifier_dir, legacy=wiring == "specforge")
        for fmt in ("speculators", "flat"):
            run_export(root, params(fmt, flags=flags))
            drafters[wiring, fmt] = shutil.copytree(root / "models/drafter", tmp / wiring / fmt)
    env = dict(os.environ) | {
        "HF_HUB_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_NO_USAGE_STATS": "1",
    }
    out = tmp / "result.json"
    proc = subprocess.run(
        [sys.executable, "-c", VLLM_SCRIPT, str(tiny_verifier_dir), str(out)]
        + [str(d) for d in drafters.values()],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    runs = {wiring: {} for wiring in EXPORTS}
    for (wiring, fmt), drafter in drafters.items():
        runs[wiring][fmt] = result[str(drafter)]
    return runs | {"baseline": result["baseline"]}


def check_both_formats(served: dict, wiring: str) -> dict:
    """Greedy outputs equal the baseline's and both exports draft identically; returns the
    speculators export's run."""
    spec, flat = served[wiring]["speculators"], served[wiring]["flat"]
    baseline = served["baseline"]
    assert spec["tokens"] == baseline["tokens"] and flat["tokens"] == baseline["tokens"]
    assert flat["counters"] == spec["counters"]
    return spec


@pytest.mark.vllm
def test_vllm_serves_flat_export_like_speculators_export(served: dict) -> None:
    """Baseline, speculators export, flat export: greedy outputs equal the baseline's, and the
    spec-decode counters of the two exports of the same weights are equal (so vLLM computes the
    same drafter from both)."""
    spec = check_both_formats(served, "speculators")
    accepted = spec["counters"]["vllm:spec_decode_num_accepted_tokens"][0]
    drafts = spec["counters"]["vllm:spec_decode_num_drafts"][0]
    assert drafts > 0
    print(f"flat == speculators export: {accepted} accepted in {drafts} drafts of {K}")


@pytest.mark.vllm
def test_vllm_serves_specforge_wired_export(served: dict) -> None:
    """The flags a SpecForge checkpoint carries (all false) survive export and vLLM 0.32 loads
    them: greedy outputs equal the baseline's, and both formats draft identically."""
    spec = check_both_formats(served, "specforge")
    assert spec["counters"]["vllm:spec_decode_num_drafts"][0] > 0
