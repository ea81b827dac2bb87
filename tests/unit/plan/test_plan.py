"""`eagle3 plan`: the Kimi-K2.5 numbers, the formula against speculators, one line per mismatch.

Fixtures (provenance in tests/fixtures/README.md): tests/fixtures/kimi-k2.5/config.json is
moonshotai/Kimi-K2.5's config.json (multimodal wrapper, DeepSeek-V3 text model under
text_config); tests/fixtures/aq-medai-kimi-k25-eagle3/config.json is the legacy flat EAGLE-3
config of AQ-MedAI/Kimi-K25-eagle3 (LlamaForCausalLMEagle3, as SpecForge's kimi-k25-eagle3.json).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from eagle3_pipeline.cli import main
from eagle3_pipeline.errors import CheckpointError, ParamsError, VerifierError
from eagle3_pipeline.params import Params, load_params
from eagle3_pipeline.plan import plan

REPO = Path(__file__).resolve().parents[3]
PROFILE = REPO / "profiles/kimi-k2.5.yaml"
KIMI = REPO / "tests/fixtures/kimi-k2.5/config.json"
AQ_MEDAI = REPO / "tests/fixtures/aq-medai-kimi-k25-eagle3/config.json"
KIMI_ARGS = ["--verifier-config", str(KIMI), "--init-config", str(AQ_MEDAI)]


def _kimi_plan(**overrides: Any) -> plan.Plan:
    params = load_params(PROFILE)
    return plan.make_plan(params, PROFILE, KIMI, AQ_MEDAI, **overrides)


def test_kimi_numbers_match_the_seeds_team() -> None:
    p = _kimi_plan(tokens=1_000_000)
    assert (p.aux_layer_ids, p.final_layer_id) == ([2, 30, 58], 61)
    assert (p.verifier.num_layers, p.verifier.hidden_size, p.verifier.vocab_size) == (
        61,
        7168,
        163840,
    )
    groups = {g.name: g.count for g in p.groups}
    assert groups["embed_tokens"] == 163840 * 7168  # 1,174.4M, frozen
    assert groups["verifier_lm_head"] == groups["lm_head"] == 32000 * 7168  # 229.4M each
    assert p.total_params == 2_594_737_152
    assert p.trainable_params == 1_190_948_864
    assert p.total_params - p.trainable_params == 163840 * 7168 + 32000 * 7168 + 7168
    assert p.store_bytes_per_token == {"bf16": 57_344, "fp8": 4 * 7168 + 4 * 4}
    text = plan.render(p)
    assert "total 2,594.7M = trainable 1,190.9M" in text
    assert "57,344 B/token bf16" in text


@pytest.mark.parametrize(("keep_last", "kept"), [(2, 3), (None, 5), (9, 5)])
def test_checkpoint_disk_need_follows_keep_last(keep_last: int | None, kept: int) -> None:
    params = load_params(PROFILE)
    params.train.keep_last = keep_last  # 5 epochs in the profile
    p = plan.make_plan(params, PROFILE, KIMI, AQ_MEDAI, tokens=1_000_000)
    assert p.checkpoints_kept == kept
    per_epoch = p.checkpoint_weights_bytes + p.checkpoint_optimizer_bytes
    assert f"kept {kept} (train.keep_last + the best): {plan._size(per_epoch * kept)}" in (
        plan.render(p)
    )


def test_kimi_plan_cli_prints_and_warns(capsys) -> None:
    rc = main(["plan", "--params", str(PROFILE), *KIMI_ARGS, "--tokens", "81920000"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "deepseek_v3 under text_config: 61 layers, hidden 7,168, vocab 163,840" in out
    assert "aux [2, 30, 58] + final 61" in out
    assert "draft 32,000 of target 163,840" in out
    assert "store 4.70 TB bf16" in out
    # 81,920,000 x 0.9 / 8,192 per batch = 9,000 steps/epoch; 5 epochs; warm-up 1% of 45,000.
    assert "9,000 steps/epoch" in out and "45,000 steps, warm-up 450" in out
    assert "norm_before_fc=false" in out  # AQ-MedAI is legacy: no input_norm, warned


def test_schedule_from_prompt_files(tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    rows = [{"id": f"p{i}", "messages": [{"role": "user", "content": "x" * 400}]} for i in range(3)]
    prompts.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    params = load_params(PROFILE).model_copy(deep=True)
    params.prepare.prompts = str(prompts)
    estimate = plan.estimate_tokens(params, tokens=None, prompts=None)
    assert estimate.total == 3 * 8192  # 100 prompt + 16,384 new, capped at max_seq_len 8,192
    params.tokenize.max_seq_len = 32768
    assert plan.estimate_tokens(params, None, None).total == 3 * (100 + 16384)
    assert plan.schedule(params, 100_000) == (90_000, 11, 55, 0)


def test_tiny_verifier_built_from_older_params_is_planned_from_the_new_ones(
    tmp_path: Path,
) -> None:
    """The verifier stage rebuilds it: an older 4-layer build must not refuse id 5 of 8."""
    params = load_params(REPO / "profiles/tiny-llama.yaml").model_copy(deep=True)
    params.verifier.path = str(tmp_path)
    (tmp_path / "config.json").write_text(
        json.dumps(
            {"model_type": "llama", "num_hidden_layers": 4, "hidden_size": 64, "vocab_size": 2048}
        )
    )
    p = plan.make_plan(params, "profiles/tiny-llama.yaml", tokens=10_000)
    assert (p.verifier.num_layers, p.aux_layer_ids, p.final_layer_id) == (8, [2, 4, 5], 8)


def test_tiny_profile_plans_before_the_verifier_is_built(tmp_path: Path) -> None:
    params = load_params(REPO / "profiles/tiny-llama.yaml").model_copy(deep=True)
    params.verifier.path = str(tmp_path / "not-built")
    p = plan.make_plan(params, "profiles/tiny-llama.yaml", tokens=10_000)
    assert (p.verifier.num_layers, p.verifier.hidden_size, p.verifier.vocab_size) == (8, 128, 2048)
    assert p.drafter.norm_before_fc and p.drafter.intermediate_size == 384
    assert p.store_bytes_per_token["bf16"] == 4 * 128 * 2


# ---- the formula against speculators 0.9.0's Eagle3DraftModel ---------------------------------


@pytest.mark.parametrize(
    ("norm_before_fc", "fc_norm", "attention_bias"),
    [(True, False, True), (False, False, False), (False, True, False)],
)
def test_parameter_formula_matches_speculators(
    tmp_path: Path, norm_before_fc: bool, fc_norm: bool, attention_bias: bool
) -> None:
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3SpeculatorConfig
    from speculators.models.eagle3.core import Eagle3DraftModel
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import LlamaConfig

    layer = LlamaConfig(
        vocab_size=1000,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        attention_bias=attention_bias,
    )
    layer._attn_implementation = "sdpa"
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer,
        draft_vocab_size=200,
        norm_before_fc=norm_before_fc,
        fc_norm=fc_norm,
        eagle_aux_hidden_state_layer_ids=[1, 3, 5, 6],
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=None, architectures=[]),
        ),
    )
    config.save_pretrained(str(tmp_path))
    model = Eagle3DraftModel(config)
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)

    shape = plan.drafter_from_init(json.loads((tmp_path / "config.json").read_text()), tmp_path)
    assert shape.aux_layer_ids == [1, 3, 5, 6] and shape.draft_vocab_size == 200
    frozen_head = plan.parameter_groups(shape, n_aux=4, train_lm_head=False)
    assert sum(g.count for g in frozen_head) == total
    assert sum(g.count for g in frozen_head if g.trainable) == trainable
    # train.train_lm_head un-freezes speculators' lm_head (speculators_compat._lm_head_trainable).
    with_head = plan.parameter_groups(shape, n_aux=4, train_lm_head=True)
    assert sum(g.count for g in with_head if g.trainable) == trainable + 200 * 64


# ---- every mismatch that would cost a week: one line, exit 2 ----------------------------------


def _profile(tmp_path: Path, mutate) -> Path:
    raw = yaml.safe_load(PROFILE.read_text())
    mutate(raw)
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _init(tmp_path: Path, **changes: Any) -> Path:
    config = json.loads(AQ_MEDAI.read_text())
    for key, value in changes.items():
        if key == "aux":
            config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = value
        else:
            config[key] = value
    path = tmp_path / "init" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(config))
    return path


def _refused(capsys, params: Path, error: type[Exception], expected: str, **paths: Path) -> None:
    verifier = paths.get("verifier", KIMI)
    init = paths.get("init", AQ_MEDAI)
    with pytest.raises(error, match=re.escape(expected)):
        plan.make_plan(load_params(params), params, verifier, init, tokens=1)
    argv = ["plan", "--params", str(params), "--verifier-config", str(verifier)]
    rc = main([*argv, "--init-config", str(init)])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.count("\n") == 1 and "Traceback" not in err and expected in err


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [
        (lambda p: p["layers"].update(aux_layer_ids=[2, 30, 61]), "[61] out of range"),
        (lambda p: p["layers"].update(aux_layer_ids=[2, 30, 30]), "has duplicates"),
        (lambda p: p["layers"].update(final_layer_id=60), "final id must equal num_hidden_layers"),
        (lambda p: p["vocab"].update(draft_vocab_size=200_000), "larger than the verifier vocab"),
    ],
    ids=["aux-out-of-range", "aux-duplicated", "final-not-N", "draft-vocab-too-large"],
)
def test_layer_and_vocab_mismatch(tmp_path: Path, capsys, mutate, expected: str) -> None:
    _refused(capsys, _profile(tmp_path, mutate), ParamsError, expected)


def test_remote_code_needed_but_not_allowed(tmp_path: Path, capsys) -> None:
    params = _profile(tmp_path, lambda p: p["verifier"].update(trust_remote_code=False))
    _refused(capsys, params, VerifierError, "has auto_map (custom code)")


def test_init_hidden_size_mismatch(tmp_path: Path, capsys) -> None:
    init = _init(tmp_path, hidden_size=4096)
    _refused(
        capsys, PROFILE, CheckpointError, "hidden_size 4096 but the verifier's is 7168", init=init
    )


def test_init_target_vocab_mismatch(tmp_path: Path, capsys) -> None:
    init = _init(tmp_path, vocab_size=128256)
    _refused(capsys, PROFILE, CheckpointError, "vocab_size 128256 but the verifier's", init=init)


def test_init_draft_vocab_mismatch_refused_only_when_asked(tmp_path: Path, capsys) -> None:
    def smaller(p: dict, mismatch: str) -> None:
        p["vocab"]["draft_vocab_size"] = 16000
        p["train"]["init_vocab_mismatch"] = mismatch

    params = _profile(tmp_path, lambda p: smaller(p, "refuse"))
    _refused(capsys, params, CheckpointError, "draft_vocab_size 32000 but vocab.draft_vocab_size")
    params = _profile(tmp_path, lambda p: smaller(p, "remap"))
    assert main(["plan", "--params", str(params), *KIMI_ARGS]) == 0
    assert "lm_head rows are remapped by target id" in capsys.readouterr().out


def test_init_aux_count_mismatch(tmp_path: Path, capsys) -> None:
    params = _profile(tmp_path, lambda p: p["layers"].update(aux_layer_ids=[2, 20, 40, 58]))
    _refused(capsys, params, CheckpointError, "fc takes 3 aux layers [2, 30, 58]")


def test_init_aux_ids_warn_with_their_convention(tmp_path: Path, capsys) -> None:
    """A flat file's ids mean what its trainer meant (SpecForge: output of layer k): warn."""
    init = _init(tmp_path, aux=[1, 29, 57])
    assert (
        main(
            [
                "plan",
                "--params",
                str(PROFILE),
                "--init-config",
                str(init),
                "--verifier-config",
                str(KIMI),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "(legacy flat) lists aux ids [1, 29, 57]" in out and "([2, 30, 58])" in out
    ours = tmp_path / "ours" / "config.json"
    ours.parent.mkdir()
    ours.write_text(json.dumps(json.loads(init.read_text()) | {"eagle3_pipeline": {}}))
    assert (
        main(
            [
                "plan",
                "--params",
                str(PROFILE),
                "--init-config",
                str(ours),
                "--verifier-config",
                str(KIMI),
            ]
        )
        == 0
    )
    assert "fc was trained on aux layers [1, 29, 57]" in capsys.readouterr().out


def test_init_config_missing(tmp_path: Path, capsys) -> None:
    missing = tmp_path / "AQ-MedAI-Kimi-K25-eagle3"
    _refused(capsys, PROFILE, CheckpointError, "config.json: not found", init=missing)


def test_reasoning_parser_needs_think_tokens(tmp_path: Path, capsys) -> None:
    verifier = tmp_path / "Kimi-K2.5"
    verifier.mkdir()
    (verifier / "config.json").write_text(KIMI.read_text())
    decoder = {"163584": {"content": "[BOS]"}, "163585": {"content": "[EOS]"}}
    (verifier / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": decoder}))
    _refused(capsys, PROFILE, VerifierError, "no <think> </think> token", verifier=verifier)
    decoder["163606"] = {"content": "<think>"}
    decoder["163607"] = {"content": "</think>"}
    (verifier / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": decoder}))
    p = plan.make_plan(load_params(PROFILE), PROFILE, verifier, AQ_MEDAI, tokens=1)
    assert p.tokenizer == "tokenizer_config.json: <think>/</think> present"


def test_kimi_profile_is_a_valid_params_file() -> None:
    params = load_params(PROFILE)
    assert isinstance(params, Params)
    assert params.verifier.name == "moonshotai/Kimi-K2.5" and params.verifier.trust_remote_code
    assert params.generate.reasoning_parser == "kimi_k2" and params.vllm.tensor_parallel_size == 8
