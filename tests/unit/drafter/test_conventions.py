"""drafter.conventions: what a checkpoint's config means, and the run's one resolution."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from builders import AQ_MEDAI as AQ_MEDAI_FILE
from builders import make_params, model_files, pretrained

from eagle3_pipeline.config.params import Params
from eagle3_pipeline.core.errors import CheckpointError
from eagle3_pipeline.drafter import conventions as conv

AQ_MEDAI = json.loads(AQ_MEDAI_FILE.read_text())
# A Kimi-K2.5-deep verifier (61 layers) read at vLLM's ids [3, 31, 59].
KIMI_LAYERS = {
    "verifier": pretrained("v"),
    "layers": {"aux_layer_ids": [3, 31, 59], "final_layer_id": 61},
}


@pytest.mark.parametrize("norm_output", [None, True])
def test_specforge_config_in_vllm_meaning(norm_output: bool | None) -> None:
    """SpecForge's norm_output (default true) = logits from norm(h), pre-norm state chained."""
    config = AQ_MEDAI if norm_output is None else AQ_MEDAI | {"norm_output": norm_output}
    c = conv.read_conventions(config, "aq")
    assert c.origin == "specforge" and c.vllm_aux_layer_ids == [3, 31, 59]
    assert c.flags == dict.fromkeys(conv.FLAGS, False)
    assert c.layer_config["head_dim"] == 128 and c.layer_config["rope_parameters"] == {
        "rope_theta": 1000000.0,
        "rope_type": "default",
    }


def test_speculators_config_as_written() -> None:
    config = {
        "speculators_model_type": "eagle3",
        "transformer_layer_config": {"hidden_size": 64, "vocab_size": 512},
        "eagle_aux_hidden_state_layer_ids": [2, 4, 5],
        "norm_before_fc": True,
    }
    c = conv.read_conventions(config, "spec")
    assert c.vllm_aux_layer_ids == [2, 4, 5]
    # vLLM reads an absent norm_before_residual as true (speculators/algos.py).
    assert c.flags == {
        "norm_before_residual": True,
        "norm_before_fc": True,
        "fc_norm": False,
        "norm_output": False,
    }


def _resolve(params: Params, num_layers: int, init: tuple | None) -> conv.RunConventions:
    return conv.resolve(params.layers, params.train, num_layers, init)


def test_no_init_is_speculators_defaults_and_params_win() -> None:
    run = _resolve(make_params(KIMI_LAYERS), 61, None)
    assert run.flags == conv.TRAINER_DEFAULT_FLAGS and run.layer_config is None
    run = _resolve(make_params(KIMI_LAYERS, train={"flags": {"norm_before_fc": False}}), 61, None)
    assert not run.flags["norm_before_fc"] and run.sources["norm_before_fc"] == "params"


def test_init_adopts_and_refuses(tmp_path: Path) -> None:
    init = (AQ_MEDAI, tmp_path / "config.json")
    run = _resolve(make_params(KIMI_LAYERS), 61, init)
    assert run.flags == dict.fromkeys(conv.FLAGS, False) and run.layer_config["head_dim"] == 128
    with pytest.raises(CheckpointError, match="train.flags.norm_output true vs the checkpoint's"):
        _resolve(make_params(KIMI_LAYERS, train={"flags": {"norm_output": True}}), 61, init)
    allowed = _resolve(
        make_params(KIMI_LAYERS, train={"flags": {"norm_output": True}, "init_mismatch": "allow"}),
        61,
        init,
    )
    assert allowed.flags["norm_output"] and len(allowed.retrained) == 1


def test_both_norms_before_fc_refused() -> None:
    with pytest.raises(CheckpointError, match="norm_before_fc and fc_norm both true"):
        _resolve(make_params(KIMI_LAYERS, train={"flags": {"fc_norm": True}}), 61, None)


def test_run_conventions_reads_init_from(tmp_path: Path) -> None:
    model_files(tmp_path, config=AQ_MEDAI)
    p = make_params(KIMI_LAYERS, train={"init_from": str(tmp_path)})
    run = conv.run_conventions(p.layers, p.train, 61)
    assert run.init_file == tmp_path / "config.json" and run.init.origin == "specforge"
    with pytest.raises(CheckpointError, match="not found"):
        p = make_params(KIMI_LAYERS, train={"init_from": str(tmp_path / "missing")})
        conv.run_conventions(p.layers, p.train, 61)


def test_evaluate_reads_a_specforge_drafter_as_published(tmp_path: Path) -> None:
    """load_drafter (evaluate's `init` entry) wires a SpecForge flat file as it was trained:
    no input_norm, every flag false, ids shifted to vLLM's."""
    import torch
    from drafter_fixtures import build_drafter, build_llama_verifier, save_legacy_flat

    from eagle3_pipeline.drafter.load import load_drafter

    verifier = build_llama_verifier(tmp_path / "verifier")
    model = build_drafter(verifier, list(range(128)), [2, 4, 5], seed=1, legacy_flags=True)
    flat = save_legacy_flat(model, tmp_path / "flat", [1, 3, 4])
    loaded = load_drafter(flat, verifier)
    assert loaded.config.eagle_aux_hidden_state_layer_ids == [2, 4, 5]
    assert {k: getattr(loaded.config, k) for k in conv.FLAGS} == dict.fromkeys(conv.FLAGS, False)
    assert loaded.input_norm is None
    want = model.to(torch.bfloat16).float().state_dict()
    got = loaded.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in got if not k.startswith("verifier_"))
