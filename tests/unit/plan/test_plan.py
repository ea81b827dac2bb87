"""`eagle3 plan`: the Kimi-K2.5 numbers end to end, and tiny profiles planned from params."""

from __future__ import annotations

from pathlib import Path

from builders import fake_verifier
from plan_cases import KIMI_ARGS, PROFILE, REPO, kimi_plan

from eagle3_pipeline.cli import main
from eagle3_pipeline.config.params import Params, load_params
from eagle3_pipeline.plan import plan, report


def test_kimi_numbers_match_the_seeds_team() -> None:
    p = kimi_plan(tokens=1_000_000)
    # AQ-MedAI's [2, 30, 58] are SpecForge's (output of layer k): vLLM's [3, 31, 59].
    assert (p.aux_layer_ids, p.final_layer_id) == ([3, 31, 59], 61)
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
    text = report.render(p)
    assert "total 2,594.7M = trainable 1,190.9M" in text
    assert "57,344 B/token bf16" in text


def test_kimi_plan_cli_prints_the_checkpoints_conventions(capsys) -> None:
    rc = main(["plan", "--params", str(PROFILE), *KIMI_ARGS, "--tokens", "81920000"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "deepseek_v3 under text_config: 61 layers, hidden 7,168, vocab 163,840" in out
    assert "aux [3, 31, 59] + final 61" in out
    assert "fc trained on [3, 31, 59] (written [2, 30, 58] in SGLang's convention): same" in out
    assert "draft 32,000 of target 163,840" in out
    # 81,920,000 tokens over the profile's 10,000 prompts: 8,192 each, 57,344 B/token in bf16.
    assert "10,000 x 8,192 = 81.9M 4.70 TB (2.35 TB) 81.9M" in " ".join(out.split())
    # 81,920,000 x 0.9 / (8 ranks x 20,480 per batch) = 450 steps/epoch; 5 epochs; warm-up 2%.
    assert "/ 163,840 per step = 450 steps/epoch" in out and "2,250 steps, warm-up 45" in out
    # AQ-MedAI is SpecForge's: no norm before fc, wired as the checkpoint was; nothing to warn.
    assert (
        "norm_before_fc false (params)" in out and "decoder layer from the init checkpoint" in out
    )
    assert "warning" not in out


def test_tiny_verifier_built_from_older_params_is_planned_from_the_new_ones(
    tmp_path: Path,
) -> None:
    """The verifier stage rebuilds it: an older 4-layer build must not refuse id 5 of 8."""
    params = load_params(REPO / "profiles/tiny-llama.yaml").model_copy(deep=True)
    params.verifier.path = str(tmp_path)
    fake_verifier(
        tmp_path,
        {"model_type": "llama", "num_hidden_layers": 4, "hidden_size": 64, "vocab_size": 2048},
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


def test_kimi_profile_is_a_valid_params_file() -> None:
    params = load_params(PROFILE)
    assert isinstance(params, Params)
    assert params.verifier.name == "moonshotai/Kimi-K2.5" and params.verifier.trust_remote_code
    assert params.generate.reasoning_parser == "kimi_k2" and params.vllm.tensor_parallel_size == 8


def test_kimi_families_profile_plans_the_union_store(capsys) -> None:
    """kimi-k2.5-families: z-lab's DFlash layers beside AQ-MedAI's EAGLE-3 ones; the store holds
    both (8 aux + final) and the plan prices it; only layers, families and the draft-count sweep
    differ from kimi-k2.5."""
    import yaml

    families = REPO / "profiles/kimi-k2.5-families.yaml"
    a, b = (yaml.safe_load(p.read_text()) for p in (PROFILE, families))
    assert {k for k in a if a[k] != b[k]} == {"profile", "layers", "families", "evaluate"}
    assert b["evaluate"] == a["evaluate"] | {"num_speculative_tokens_sweep": [7]}
    assert b["layers"]["family_aux_layer_ids"]["dflash"] == [2, 13, 25, 36, 48, 59]
    p = plan.make_plan(load_params(families), families, *KIMI_ARGS[1::2])
    assert p.aux_layer_ids == [3, 31, 59]  # train's drafter as in kimi-k2.5
    assert p.store_aux_layer_ids == [2, 3, 13, 25, 31, 36, 48, 59]
    assert p.store_bytes_per_token["bf16"] == 9 * 7168 * 2
    assert kimi_plan().store_bytes_per_token["bf16"] == 4 * 7168 * 2
    rc = main(["plan", "--params", str(families), *KIMI_ARGS, "--tokens", "1000000"])
    out = capsys.readouterr().out
    assert rc == 0 and "9 layers x 7,168: 129,024 B/token bf16" in out
    assert "aux [2, 3, 13, 25, 31, 36, 48, 59] + final: the union of train's [3, 31, 59]" in out
