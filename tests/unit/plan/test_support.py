"""The installed vLLM against the verifier's class, for real: Llama implements SupportsEagle3,
Gemma-2 and OPT are in vLLM 0.32's registry without it, a made-up architecture is unknown.

The classes are loaded through vLLM's registry (importing vLLM once, ~7 s, then one model
module each); every test gets its own answer cache.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from builders import fake_verifier
from plan_cases import KIMI, PROFILE, REPO, profile, refused

from eagle3_pipeline.config.params import Params, load_params
from eagle3_pipeline.core.errors import ParamsError, ServerError, VerifierError
from eagle3_pipeline.plan import support, vllm_classes, vllm_needs

PRETRAINED = REPO / "profiles/pretrained.yaml"
# vLLM 0.32 registers both, and neither class implements SupportsEagle3 (gemma2.py, opt.py).
# transformers keeps Gemma-2's decoder layers at model.layers (the hf backend's hooks find
# them), OPT's at model.decoder.layers (they do not).
GEMMA2 = {
    "architectures": ["Gemma2ForCausalLM"],
    "model_type": "gemma2",
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "vocab_size": 512,
}
OPT = {
    "architectures": ["OPTForCausalLM"],
    "model_type": "opt",
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "ffn_dim": 128,
    "num_attention_heads": 2,
    "word_embed_proj_dim": 64,
    "vocab_size": 512,
}
MADE_UP = {
    "architectures": ["Eagle3PipelineMadeUpForCausalLM"],
    "model_type": "eagle3_pipeline_made_up",
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "vocab_size": 512,
}


@pytest.fixture(autouse=True)
def _own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(support, "CACHE", tmp_path / "vllm_classes.json")


def _verifier(tmp_path: Path, config: dict[str, Any], **changes: Any) -> tuple[Params, Path]:
    """profiles/pretrained.yaml pointed at a folder holding `config` (no weights, no
    tokenizer), with `changes` ("extract.backend": "hf", ...) applied."""
    folder = fake_verifier(tmp_path / config["architectures"][0], config)
    params = load_params(PRETRAINED).model_copy(deep=True)
    params.verifier.path = str(folder)
    for key, value in changes.items():
        section, attr = key.split(".")
        setattr(getattr(params, section), attr, value)
    return params, folder


def _check(params: Params, folder: Path) -> support.VllmSupport:
    config = json.loads((folder / "config.json").read_text())
    return support.check_vllm(params, config, str(folder / "config.json"), folder, support.CACHE)


def test_tiny_llama_before_it_is_built_implements_eagle3() -> None:
    params = load_params(REPO / "profiles/tiny-llama.yaml")
    s = support.check_vllm(params, None, "params.yaml (verifier.tiny)", cache=support.CACHE)
    assert (s.architecture, s.model_class, s.eagle3) == ("LlamaForCausalLM",) * 2 + (True,)
    assert s.version and s.drafters["Eagle3LlamaForCausalLM"]
    assert s.uses == ["extract.backend: vllm", "evaluate.online: true"]
    assert s.record()["supports_eagle3"] is True


def test_registered_class_without_eagle3_is_refused_naming_every_way_out(tmp_path: Path) -> None:
    params, folder = _verifier(tmp_path, GEMMA2)
    with pytest.raises(VerifierError) as err:
        _check(params, folder)
    line = str(err.value)
    assert "\n" not in line
    assert "Gemma2ForCausalLM does not implement SupportsEagle3" in line
    assert "which extract.backend: vllm, evaluate.online: true need" in line
    assert "choose a verifier whose vLLM class implements it" in line
    assert '"--model-impl", "transformers" to vllm.extra_args' in line
    assert "measured offline only: extract.backend: hf, evaluate.online: false" in line


def test_hf_backend_is_not_offered_where_its_hooks_find_no_layers(tmp_path: Path) -> None:
    params, folder = _verifier(tmp_path, OPT)
    with pytest.raises(VerifierError) as err:
        _check(params, folder)
    line = str(err.value)
    assert "OPTForCausalLM does not implement SupportsEagle3" in line
    assert "measured offline only" not in line
    assert "the hf extract backend cannot capture it either: transformers' OPTForCausalLM" in line


def test_without_a_stage_that_needs_it_the_missing_interface_is_a_note(tmp_path: Path) -> None:
    params, folder = _verifier(
        tmp_path, GEMMA2, **{"extract.backend": "hf", "evaluate.online": False}
    )
    s = _check(params, folder)
    assert s.eagle3 is False and s.uses == []
    assert "vLLM cannot serve a drafter beside it" in s.describe()


def test_transformers_backend_implements_it(tmp_path: Path) -> None:
    params, folder = _verifier(
        tmp_path, GEMMA2, **{"vllm.extra_args": ["--model-impl", "transformers"]}
    )
    s = _check(params, folder)
    assert (s.architecture, s.model_class, s.eagle3) == (
        "Gemma2ForCausalLM",
        "TransformersForCausalLM",
        True,
    )


def test_made_up_architecture_is_unknown_to_vllm(tmp_path: Path) -> None:
    params, folder = _verifier(tmp_path, MADE_UP)
    with pytest.raises(VerifierError, match="does not know the architecture Eagle3PipelineMadeUp"):
        _check(params, folder)
    params.generate.backend = params.extract.backend = "hf"
    params.evaluate.online = False
    s = _check(params, folder)  # nothing uses vLLM: a note
    assert s.model_class is None and "no stage uses vLLM" in s.describe()


def test_kimi_wrapper_and_its_language_model_both_implement_it() -> None:
    s = support.check_vllm(load_params(PROFILE), json.loads(KIMI.read_text()), str(KIMI))
    assert (s.architecture, s.language_model, s.eagle3) == (
        "KimiK25ForConditionalGeneration",
        "DeepseekV3ForCausalLM",
        True,
    )


def test_plan_refuses_the_verifier_before_any_estimate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`eagle3 plan` exits 2 with the one line, for a Gemma-2 verifier under the Kimi profile."""
    folder = fake_verifier(tmp_path / "gemma2", GEMMA2 | {"vocab_size": 163840})
    params = profile(tmp_path, lambda p: p["verifier"].update(trust_remote_code=False))
    refused(
        capsys,
        params,
        VerifierError,
        "Gemma2ForCausalLM does not implement SupportsEagle3",
        verifier=folder,
    )


def test_vllm_not_installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An error where a stage here starts vLLM, a note where none does."""
    real = support.importlib.util.find_spec
    monkeypatch.setattr(
        support.importlib.util, "find_spec", lambda n, *a: None if n == "vllm" else real(n, *a)
    )
    params = load_params(REPO / "profiles/tiny-llama.yaml").model_copy(deep=True)
    with pytest.raises(ParamsError) as err:
        support.check_vllm(params, None, "here")
    assert str(err.value) == (
        "vLLM is not installed here but generate.backend: vllm, extract.backend: vllm, "
        "evaluate.online: true start it on this machine: install it (make venv; the image has "
        "it), or set generate.backend: hf, extract.backend: hf, evaluate.online: false"
    )
    params.generate.backend = params.extract.backend = "hf"
    params.evaluate.online = False
    s = support.check_vllm(params, None, "here")
    assert s.version is None and s.record() == {"installed": False}
    assert "not installed here" in s.describe()


def test_a_drafter_class_vllm_lacks_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(vllm_needs.DRAFTER_ARCHITECTURES, "dflash", "NoSuchDFlashDraftModel")
    params = load_params(REPO / "profiles/tiny-llama-families.yaml")
    with pytest.raises(VerifierError, match="no NoSuchDFlashDraftModel in its model registry"):
        support.check_vllm(params, None, "here")


def test_answers_are_cached_against_vllms_files(monkeypatch: pytest.MonkeyPatch) -> None:
    params = load_params(REPO / "profiles/tiny-llama.yaml")
    first = support.check_vllm(params, None, "here", cache=support.CACHE)

    def no_vllm() -> None:
        raise ImportError("vLLM must not be imported on a cached answer")

    monkeypatch.setattr(vllm_classes, "_import_vllm", no_vllm)
    assert support.check_vllm(params, None, "here", cache=support.CACHE) == first
    data = json.loads(support.CACHE.read_text())
    data["classes"]["LlamaForCausalLM"]["files"][0][1] += 1  # llama.py changed since
    support.CACHE.write_text(json.dumps(data))
    with pytest.raises(ServerError, match="vLLM is installed but does not import"):
        support.check_vllm(params, None, "here", cache=support.CACHE)
