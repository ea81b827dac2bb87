"""checks: every mismatch that would cost a week is one line and exit 2; the rest are warnings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from builders import fake_verifier, model_files
from plan_cases import AQ_MEDAI, KIMI, KIMI_ARGS, PROFILE, init_config, profile, refused

from eagle3_pipeline.cli import main
from eagle3_pipeline.config.params import load_params
from eagle3_pipeline.core.errors import CheckpointError, ParamsError, VerifierError
from eagle3_pipeline.plan import plan


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
    refused(capsys, profile(tmp_path, mutate), ParamsError, expected)


def test_remote_code_needed_but_not_allowed(tmp_path: Path, capsys) -> None:
    params = profile(tmp_path, lambda p: p["verifier"].update(trust_remote_code=False))
    refused(capsys, params, VerifierError, "has auto_map (custom code)")


def test_init_hidden_size_mismatch(tmp_path: Path, capsys) -> None:
    init = init_config(tmp_path, hidden_size=4096)
    refused(
        capsys, PROFILE, CheckpointError, "hidden_size 4096 but the verifier's is 7168", init=init
    )


def test_init_target_vocab_mismatch(tmp_path: Path, capsys) -> None:
    init = init_config(tmp_path, vocab_size=128256)
    refused(capsys, PROFILE, CheckpointError, "vocab_size 128256 but the verifier's", init=init)


def test_init_draft_vocab_mismatch_refused_only_when_asked(tmp_path: Path, capsys) -> None:
    def smaller(p: dict, mismatch: str) -> None:
        p["vocab"]["draft_vocab_size"] = 16000
        p["train"]["init_vocab_mismatch"] = mismatch

    params = profile(tmp_path, lambda p: smaller(p, "refuse"))
    refused(capsys, params, CheckpointError, "draft_vocab_size 32000 but vocab.draft_vocab_size")
    params = profile(tmp_path, lambda p: smaller(p, "remap"))
    assert main(["plan", "--params", str(params), *KIMI_ARGS]) == 0
    assert "lm_head rows are remapped by target id" in capsys.readouterr().out


def test_init_aux_count_mismatch(tmp_path: Path, capsys) -> None:
    params = profile(tmp_path, lambda p: p["layers"].update(aux_layer_ids=[2, 20, 40, 58]))
    refused(capsys, params, CheckpointError, "fc takes 3 aux layers [3, 31, 59]")


def test_init_aux_ids_refused_naming_both_in_vllm_convention(tmp_path: Path, capsys) -> None:
    """The seeds' Kimi run: ids as written in AQ-MedAI's file are one layer early for vLLM."""
    old = profile(tmp_path, lambda p: p["layers"].update(aux_layer_ids=[2, 30, 58]))
    expected = (
        "layers.aux_layer_ids [2, 30, 58] vs the checkpoint's [3, 31, 59] (written [2, 30, 58] "
        "in SGLang's convention)"
    )
    refused(capsys, old, CheckpointError, expected)


def test_init_mismatch_allow_retrains_and_warns(tmp_path: Path, capsys) -> None:
    def allow(p: dict) -> None:
        p["layers"]["aux_layer_ids"] = [2, 30, 58]
        p["train"]["flags"]["norm_before_fc"] = True
        p["train"]["init_mismatch"] = "allow"

    assert main(["plan", "--params", str(profile(tmp_path, allow)), *KIMI_ARGS]) == 0
    out = capsys.readouterr().out
    assert "init checkpoint's fc trained on [3, 31, 59]" in out and "DIFFERENT" in out
    assert "warning     train.init_mismatch allow: layers.aux_layer_ids [2, 30, 58]" in out
    assert "train.flags.norm_before_fc true vs the checkpoint's false" in out


@pytest.mark.parametrize(
    ("flag", "value", "checkpoint"),
    [("norm_before_fc", True, "false"), ("norm_output", True, "false")],
)
def test_init_flag_refused_naming_both(
    tmp_path: Path, capsys, flag: str, value: bool, checkpoint: str
) -> None:
    params = profile(tmp_path, lambda p: p["train"]["flags"].update({flag: value}))
    expected = f"train.flags.{flag} true vs the checkpoint's {checkpoint}"
    refused(capsys, params, CheckpointError, expected)


def test_null_flags_adopt_the_checkpoints(tmp_path: Path) -> None:
    """SpecForge's fc_norm (per-layer norms) is speculators' fc_norm: adopted when params say
    nothing; speculators' own defaults would have put a norm before fc instead."""
    params = profile(tmp_path, lambda p: p["train"].update(flags={}))
    init = init_config(tmp_path, fc_norm=True)
    p = plan.make_plan(load_params(params), params, KIMI, init, tokens=1)
    assert p.conventions.flags == {
        "norm_before_residual": False,
        "norm_before_fc": False,
        "fc_norm": True,
        "norm_output": False,
    }
    assert set(p.conventions.sources.values()) == {"init checkpoint"}
    assert p.drafter.fc_norm and not p.drafter.norm_before_fc


def test_specforge_norm_output_false_refused(tmp_path: Path, capsys) -> None:
    """SpecForge norm_output false = logits from the un-normed state: vLLM cannot serve it."""
    init = init_config(tmp_path, norm_output=False)
    refused(capsys, PROFILE, CheckpointError, "norm_output false: in SpecForge", init=init)


def test_target_hidden_size_speculators_cannot_train_refused(tmp_path: Path, capsys) -> None:
    init = init_config(tmp_path, target_hidden_size=4096)
    refused(capsys, PROFILE, CheckpointError, "target_hidden_size 4096 differs", init=init)


def test_own_flat_export_ids_read_as_written(tmp_path: Path) -> None:
    """A flat file this pipeline exported records its convention: vLLM ids are not shifted."""
    ours = init_config(tmp_path, aux=[3, 31, 59], eagle3_pipeline={"layer_convention": "vllm"})
    p = plan.make_plan(load_params(PROFILE), PROFILE, KIMI, ours, tokens=1)
    assert p.conventions.init.vllm_aux_layer_ids == [3, 31, 59]
    sglang = model_files(
        tmp_path / "sglang",
        config=json.loads(ours.read_text())
        | {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 30, 58]}}
        | {"eagle3_pipeline": {"layer_convention": "sglang"}},
    )
    p = plan.make_plan(load_params(PROFILE), PROFILE, KIMI, sglang, tokens=1)
    assert p.conventions.init.vllm_aux_layer_ids == [3, 31, 59]


def test_reasoning_parser_needs_think_tokens(tmp_path: Path, capsys) -> None:
    decoder = {"163584": {"content": "[BOS]"}, "163585": {"content": "[EOS]"}}
    verifier = fake_verifier(
        tmp_path / "Kimi-K2.5", KIMI, tokenizer_config={"added_tokens_decoder": decoder}
    )
    refused(capsys, PROFILE, VerifierError, "no <think> </think> token", verifier=verifier)
    decoder["163606"] = {"content": "<think>"}
    decoder["163607"] = {"content": "</think>"}
    model_files(verifier, tokenizer_config={"added_tokens_decoder": decoder})
    p = plan.make_plan(load_params(PROFILE), PROFILE, verifier, AQ_MEDAI, tokens=1)
    assert p.tokenizer == "tokenizer_config.json: <think>/</think> present"
