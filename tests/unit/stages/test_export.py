"""Stage `export`, both formats: what it writes, and what it refuses (vLLM serving the exports:
tests/integration/test_export.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from drafter_fixtures import build_llama_verifier
from export_repo import AUX, SPECFORGE_FLAGS, make_repo, params, run_export

from eagle3_pipeline.core.errors import CheckpointError
from eagle3_pipeline.drafter import load as drafter
from eagle3_pipeline.stages import export


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


def _vllm_draft_hf_config(path: Path):
    """The draft hf_config vLLM serves `path` with: its own config loader, then the EAGLE
    wrapper SpeculativeConfig puts around a non-speculators config for method eagle3."""
    from vllm.transformers_utils.config import get_config
    from vllm.transformers_utils.configs.eagle import EAGLEConfig
    from vllm.transformers_utils.configs.speculators import SpeculatorsConfig

    config = get_config(str(path), trust_remote_code=False)
    if not isinstance(config, (EAGLEConfig, SpeculatorsConfig)):
        config = EAGLEConfig(config, method="eagle3", model_type="eagle")
    return config


def test_both_vllm_model_runners_read_the_runs_aux_ids(verifier: Path, tmp_path: Path) -> None:
    """Every export format, read by vLLM's own readers: Model Runner V2 (what vLLM 0.32 picks on
    GPUs) and V1 (CPU) both get the run's aux ids, not the verifier's default layers."""
    from types import SimpleNamespace

    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import (
        get_eagle3_aux_layers_from_config as mrv2_reader,
    )
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    root = make_repo(tmp_path / "repo", verifier, legacy=True)
    for fmt, server in (("speculators", "vllm"), ("flat", "vllm"), ("flat", "sglang")):
        run_export(root, params(fmt, server, flags=SPECFORGE_FLAGS))
        hf_config = _vllm_draft_hf_config(root / "models/drafter")
        spec = SimpleNamespace(draft_model_config=SimpleNamespace(hf_config=hf_config))
        v1 = GPUModelRunner._get_eagle3_aux_layers_from_config(  # noqa: SLF001
            SimpleNamespace(speculative_config=spec)
        )
        assert mrv2_reader(spec) == tuple(AUX), (fmt, server)
        assert v1 == tuple(AUX), (fmt, server)
