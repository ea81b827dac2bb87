"""The Kimi-K2.5 case the plan tests share, and a helper that checks one refusal end to end.

Fixtures (provenance in tests/fixtures/README.md): tests/fixtures/kimi-k2.5/config.json is
moonshotai/Kimi-K2.5's config.json (multimodal wrapper, DeepSeek-V3 text model under
text_config); tests/fixtures/aq-medai-kimi-k25-eagle3/config.json is the legacy flat EAGLE-3
config of AQ-MedAI/Kimi-K25-eagle3 (LlamaForCausalLMEagle3, as SpecForge's kimi-k25-eagle3.json).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from builders import AQ_MEDAI, KIMI, REPO, model_files

from eagle3_pipeline.cli import main
from eagle3_pipeline.config.params import load_params
from eagle3_pipeline.plan import plan

PROFILE = REPO / "profiles/kimi-k2.5.yaml"
KIMI_ARGS = ["--verifier-config", str(KIMI), "--init-config", str(AQ_MEDAI)]


def char_tokenizer(folder: Path, template: str | None) -> Path:
    """A character-level tokenizer with <think> tokens, saved as transformers 5 saves one (the
    template, if any, as chat_template.jinja)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokens = ["<unk>", "<s>", "</s>", "<think>", "</think>"] + [chr(c) for c in range(32, 127)]
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(tokens)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        additional_special_tokens=["<think>", "</think>"],
    )
    if template is not None:
        fast.chat_template = template
    folder.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(folder)
    return folder


def kimi_plan(**overrides: Any) -> plan.Plan:
    params = load_params(PROFILE)
    return plan.make_plan(params, PROFILE, KIMI, AQ_MEDAI, **overrides)


def profile(tmp_path: Path, mutate: Callable[[dict], Any]) -> Path:
    """The Kimi profile with `mutate` applied, written as tmp_path/params.yaml."""
    raw = yaml.safe_load(PROFILE.read_text())
    mutate(raw)
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def init_config(tmp_path: Path, **changes: Any) -> Path:
    """AQ-MedAI's config with `changes` (aux= sets its aux layer ids), as tmp_path/init/."""
    config = json.loads(AQ_MEDAI.read_text())
    for key, value in changes.items():
        if key == "aux":
            config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = value
        else:
            config[key] = value
    return model_files(tmp_path / "init", config=config) / "config.json"


def refused(capsys, params: Path, error: type[Exception], expected: str, **paths: Path) -> None:
    """make_plan raises `error`; `eagle3 plan` prints it as one line and exits 2."""
    verifier = paths.get("verifier", KIMI)
    init = paths.get("init", AQ_MEDAI)
    with pytest.raises(error, match=re.escape(expected)):
        plan.make_plan(load_params(params), params, verifier, init, tokens=1)
    argv = ["plan", "--params", str(params), "--verifier-config", str(verifier)]
    rc = main([*argv, "--init-config", str(init)])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.count("\n") == 1 and "Traceback" not in err and expected in err
