"""Stage `export`, both formats; vLLM serves the flat export like the speculators one."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from drafter_fixtures import build_drafter, build_llama_verifier, mapping

from eagle3_pipeline.drafter import load as drafter
from eagle3_pipeline.errors import CheckpointError
from eagle3_pipeline.params import Params
from eagle3_pipeline.stages import export

AUX = [2, 4, 7]  # 7: the last layer's input, so a drafter that reads it predicts the verifier
DRAFT_IDS = list(range(0, 256))
K = 3


def make_repo(root: Path, verifier: Path, legacy: bool = False) -> Path:
    """A workspace as export finds it: data/verifier, data/vocab, models/trained/best.

    The drafter is random except that it predicts from the last layer's input through the
    verifier's own lm_head rows (fc reads aux block 3, attention and MLP outputs are zero),
    so vLLM accepts some of its drafts and every norm flag changes which ones. `legacy` wires it
    as SpecForge does (every flag false), as a run initialised from such a drafter trains it.
    """
    root.mkdir(parents=True, exist_ok=True)
    shutil.copytree(verifier, root / "data" / "verifier")
    cwd = Path.cwd()
    os.chdir(root)
    try:
        model = build_drafter(
            Path("data/verifier"),
            DRAFT_IDS,
            AUX,
            seed=5,
            random_head=False,
            legacy_flags=legacy,
        )
    finally:
        os.chdir(cwd)
    h = model.hidden_size
    with torch.no_grad():
        model.fc.weight.zero_()
        model.fc.weight[:, 2 * h :] = torch.eye(h)
        model.layers[0].self_attn.o_proj.weight.zero_()
        model.layers[0].mlp.down_proj.weight.zero_()
    model.to(torch.bfloat16).save_pretrained(root / "models" / "trained" / "best")
    d2t, t2d = mapping(DRAFT_IDS, model.verifier_vocab_size)
    (root / "data" / "vocab").mkdir(parents=True)
    np.save(root / "data" / "vocab" / "d2t.npy", d2t.numpy())
    np.save(root / "data" / "vocab" / "t2d.npy", t2d.numpy())
    return root


SPECFORGE_FLAGS = dict.fromkeys(
    ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"), False
)


def params(fmt: str = "flat", server: str = "vllm", flags: dict | None = None) -> Params:
    return Params.model_validate(
        {
            "layers": {"aux_layer_ids": AUX},
            "train": {"flags": flags or {}},
            "vocab": {"draft_vocab_size": len(DRAFT_IDS)},
            "export": {"format": fmt, "server": server},
            "evaluate": {"num_speculative_tokens": K},
        }
    )


def run_export(root: Path, p: Params) -> dict:
    cwd = Path.cwd()
    os.chdir(root)
    try:
        export.run(p)
    finally:
        os.chdir(cwd)
    return json.loads((root / "models" / "drafter" / "config.json").read_text())


@pytest.fixture(scope="module")
def verifier(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_llama_verifier(tmp_path_factory.mktemp("v") / "verifier")


def test_flat_export_for_vllm(verifier: Path, tmp_path: Path) -> None:
    root = make_repo(tmp_path / "repo", verifier)
    config = run_export(root, params("flat"))
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == AUX
    assert config["eagle3_pipeline"]["layer_convention"] == "vllm"
    assert config["eagle3_pipeline"]["verifier"]["name_or_path"] == "data/verifier"
    assert config["norm_before_fc"] and config["norm_output"] and config["norm_before_residual"]
    # Stage-level proof: the tensors read back equal the trained ones (export.check_same_tensors).
    export.check_same_tensors(root / "models/trained/best", root / "models/drafter")
    # evaluate reads the flat export through drafter.py as it reads a speculators one.
    cwd = Path.cwd()
    os.chdir(root)
    try:
        flat = drafter.load_drafter("models/drafter", "data/verifier").state_dict()
        spec = drafter.load_drafter("models/trained/best", "data/verifier").state_dict()
        mapping_ = drafter.load_mapping("data/vocab")
        fresh = drafter.fresh_drafter_like("models/drafter", "data/verifier", *mapping_, 0)
    finally:
        os.chdir(cwd)
    assert flat.keys() == spec.keys() and all(torch.equal(flat[k], spec[k]) for k in flat)
    assert fresh.config.norm_output and fresh.config.eagle_aux_hidden_state_layer_ids == AUX


def test_sglang_export_refuses_the_trainers_drafter(verifier: Path, tmp_path: Path) -> None:
    """speculators' trainer wires norm_before_residual/fc/output true, which SGLang cannot
    compute (flat_format.check_server; the shifted ids are tested in test_flat_format)."""
    trained = make_repo(tmp_path / "trained", verifier)
    before = run_export(trained, params("speculators"))
    with pytest.raises(CheckpointError, match="export.server sglang cannot serve this drafter"):
        run_export(trained, params("flat", "sglang"))
    after = json.loads((trained / "models/drafter/config.json").read_text())
    assert after == before  # the previous export is untouched


def test_flat_export_refuses_a_tampered_copy(verifier: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    root = make_repo(tmp_path / "repo", verifier)
    run_export(root, params("flat"))
    weights = load_file(str(root / "models/drafter/model.safetensors"))
    weights["fc.weight"] = weights["fc.weight"] * 2
    save_file(weights, str(root / "models/drafter/model.safetensors"))
    with pytest.raises(CheckpointError, match="fc.weight differs"):
        export.check_same_tensors(root / "models/trained/best", root / "models/drafter")


def test_export_writes_the_runs_flags(verifier: Path, tmp_path: Path) -> None:
    """A run with SpecForge's wiring exports it, every flag explicit (vLLM reads an absent
    norm_before_residual as true); params that disagree with the checkpoint are refused."""
    root = make_repo(tmp_path / "repo", verifier, legacy=True)
    with pytest.raises(CheckpointError, match="norm_before_fc: checkpoint False vs params True"):
        run_export(root, params("speculators"))
    config = run_export(root, params("speculators", flags=SPECFORGE_FLAGS))
    assert {k: config[k] for k in SPECFORGE_FLAGS} == SPECFORGE_FLAGS
    flat = run_export(root, params("flat", flags=SPECFORGE_FLAGS))
    assert {k: flat[k] for k in SPECFORGE_FLAGS} == SPECFORGE_FLAGS
    # SGLang computes exactly this wiring: the flat export for it is allowed now.
    sglang = run_export(root, params("flat", "sglang", flags=SPECFORGE_FLAGS))
    assert sglang["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [i - 1 for i in AUX]


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
    for drafter in [None, *drafters]:
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


def serve_both_exports(verifier: Path, tmp_path: Path) -> dict:
    """vLLM in one subprocess: the baseline, then tmp_path/spec and tmp_path/flat as drafters.
    Asserts greedy outputs equal the baseline's and both exports draft identically; returns the
    speculators export's run."""
    env = dict(os.environ)
    env |= {
        "HF_HUB_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CACHE_ROOT": str(tmp_path / "vllm-cache"),
        "VLLM_NO_USAGE_STATS": "1",
    }
    out = tmp_path / "result.json"
    proc = subprocess.run(
        [sys.executable, "-c", VLLM_SCRIPT, str(verifier), str(out)]
        + [str(tmp_path / "spec"), str(tmp_path / "flat")],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    baseline = result.pop("baseline")
    spec, flat = result[str(tmp_path / "spec")], result[str(tmp_path / "flat")]
    assert spec["tokens"] == baseline["tokens"] and flat["tokens"] == baseline["tokens"]
    assert flat["counters"] == spec["counters"]
    return spec


@pytest.mark.vllm
def test_vllm_serves_flat_export_like_speculators_export(
    tiny_verifier_dir: Path, tmp_path: Path
) -> None:
    """One process, one in-process engine at a time: baseline, speculators export, flat export.
    Greedy outputs equal the baseline's, and the spec-decode counters of the two exports of the
    same weights are equal (so vLLM computes the same drafter from both)."""
    root = make_repo(tmp_path / "repo", tiny_verifier_dir)
    run_export(root, params("speculators"))
    shutil.copytree(root / "models/drafter", tmp_path / "spec")
    run_export(root, params("flat"))
    shutil.copytree(root / "models/drafter", tmp_path / "flat")
    spec = serve_both_exports(tiny_verifier_dir, tmp_path)
    accepted = spec["counters"]["vllm:spec_decode_num_accepted_tokens"][0]
    drafts = spec["counters"]["vllm:spec_decode_num_drafts"][0]
    assert drafts > 0
    print(f"flat == speculators export: {accepted} accepted in {drafts} drafts of {K}")


@pytest.mark.vllm
def test_vllm_serves_specforge_wired_export(tiny_verifier_dir: Path, tmp_path: Path) -> None:
    """The flags a SpecForge checkpoint carries (all false) survive export and vLLM 0.32 loads
    them: greedy outputs equal the baseline's, and both formats draft identically."""
    root = make_repo(tmp_path / "repo", tiny_verifier_dir, legacy=True)
    run_export(root, params("speculators", flags=SPECFORGE_FLAGS))
    shutil.copytree(root / "models/drafter", tmp_path / "spec")
    run_export(root, params("flat", flags=SPECFORGE_FLAGS))
    shutil.copytree(root / "models/drafter", tmp_path / "flat")
    spec = serve_both_exports(tiny_verifier_dir, tmp_path)
    assert spec["counters"]["vllm:spec_decode_num_drafts"][0] > 0
