"""checks: every mismatch that would cost a week is one line and exit 2; the rest are warnings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from plan_cases import AQ_MEDAI, KIMI, KIMI_ARGS, PROFILE, init_config, profile, refused

from eagle3_pipeline.cli import main
from eagle3_pipeline.errors import CheckpointError, ParamsError, VerifierError
from eagle3_pipeline.params import load_params
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
    refused(capsys, params, CheckpointError, "fc takes 3 aux layers [2, 30, 58]")


def test_init_aux_ids_warn_with_their_convention(tmp_path: Path, capsys) -> None:
    """A flat file's ids mean what its trainer meant (SpecForge: output of layer k): warn."""
    init = init_config(tmp_path, aux=[1, 29, 57])
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


def test_reasoning_parser_needs_think_tokens(tmp_path: Path, capsys) -> None:
    verifier = tmp_path / "Kimi-K2.5"
    verifier.mkdir()
    (verifier / "config.json").write_text(KIMI.read_text())
    decoder = {"163584": {"content": "[BOS]"}, "163585": {"content": "[EOS]"}}
    (verifier / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": decoder}))
    refused(capsys, PROFILE, VerifierError, "no <think> </think> token", verifier=verifier)
    decoder["163606"] = {"content": "<think>"}
    decoder["163607"] = {"content": "</think>"}
    (verifier / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": decoder}))
    p = plan.make_plan(load_params(PROFILE), PROFILE, verifier, AQ_MEDAI, tokens=1)
    assert p.tokenizer == "tokenizer_config.json: <think>/</think> present"
