"""The verifier's chat template: where transformers 5's AutoTokenizer reads it, and whether it
renders a conversation with generate.chat_template_kwargs; each failure one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from builders import LLAMA, TINY_LLAMA, fake_verifier, make_params, model_files, pretrained
from plan_cases import char_tokenizer

from eagle3_pipeline.cli import main
from eagle3_pipeline.core.errors import VerifierError
from eagle3_pipeline.plan import support, template

TEMPLATE = (
    "{%- for m in messages -%}<{{ m.role }}>{{ m.content }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}<assistant>{%- if thinking %}<think>{% endif -%}{%- endif -%}"
)
# Refuses a kwarg value it cannot use, as Qwen3's and Kimi's templates do with their switches.
STRICT = (
    "{%- if thinking is defined and thinking is not boolean -%}"
    "{{ raise_exception('thinking must be true or false') }}{%- endif -%}" + TEMPLATE
)
DROPS_CONTENT = "{%- for m in messages -%}<{{ m.role }}>{%- endfor -%}"


def test_template_renders_with_the_kwargs(tmp_path: Path) -> None:
    folder = char_tokenizer(tmp_path / "v", STRICT)
    params = make_params(TINY_LLAMA, verifier=pretrained(folder))
    t = template.check_chat_template(params, folder, required=True)
    assert (t.source, t.rendered) == ("chat_template.jinja", True)
    assert t.record() == {"source": "chat_template.jinja", "rendered": True}


def test_template_in_tokenizer_config_is_read_too(tmp_path: Path) -> None:
    folder = char_tokenizer(tmp_path / "v", None)
    params = make_params(TINY_LLAMA, verifier=pretrained(folder))
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    model_files(folder, tokenizer_config=cfg | {"chat_template": TEMPLATE})
    t = template.check_chat_template(params, folder, required=True)
    assert (t.source, t.rendered) == ("tokenizer_config.json", True)


def test_no_template_is_one_line(tmp_path: Path) -> None:
    folder = char_tokenizer(tmp_path / "v", None)
    params = make_params(TINY_LLAMA, verifier=pretrained(folder))
    with pytest.raises(VerifierError, match="no chat template") as err:
        template.check_chat_template(params, folder, required=False)
    assert "\n" not in str(err.value) and "chat_template.jinja" in str(err.value)


def test_processor_template_file_alone_is_named(tmp_path: Path) -> None:
    """chat_template.json is a processor's file: AutoTokenizer, as the stages load the
    tokenizer, leaves chat_template unset."""
    folder = char_tokenizer(tmp_path / "v", None)
    params = make_params(TINY_LLAMA, verifier=pretrained(folder))
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    with pytest.raises(VerifierError, match="in a processor's file") as err:
        template.check_chat_template(params, folder, required=False)
    assert "chat_template.jinja" in str(err.value)


def test_template_failing_with_the_kwargs_names_them(tmp_path: Path) -> None:
    folder = char_tokenizer(tmp_path / "v", STRICT)
    kwargs = {"chat_template_kwargs": {"thinking": "yes"}}
    params = make_params(TINY_LLAMA, verifier=pretrained(folder), generate=kwargs)
    with pytest.raises(VerifierError) as err:
        template.check_chat_template(params, folder, required=False)
    line = str(err.value)
    assert "\n" not in line and line.startswith(f"{folder}/chat_template.jinja: ")
    assert "{'thinking': 'yes'}" in line and "thinking must be true or false" in line


def test_template_dropping_the_users_message_is_refused(tmp_path: Path) -> None:
    folder = char_tokenizer(tmp_path / "v", DROPS_CONTENT)
    params = make_params(TINY_LLAMA, verifier=pretrained(folder))
    with pytest.raises(VerifierError, match="drops the user's message"):
        template.check_chat_template(params, folder, required=False)


def test_no_tokenizer_is_a_note_for_plan_and_an_error_for_the_check_stage(tmp_path: Path) -> None:
    folder = tmp_path / "config-only"
    folder.mkdir()
    params = make_params(TINY_LLAMA, verifier=pretrained(folder))
    t = template.check_chat_template(params, folder, required=False)
    assert not t.rendered and t.describe().endswith("not checked")
    with pytest.raises(VerifierError, match="the tokenizer does not load"):
        template.check_chat_template(params, folder, required=True)


def test_tiny_verifier_not_built_uses_the_projects_template() -> None:
    params = make_params(TINY_LLAMA, verifier=pretrained(Path("unused")))
    t = template.check_chat_template(params, None, required=True)
    assert t.record() == {"source": "the project's own (verifier/tiny.py)", "rendered": False}


def test_plan_refuses_a_verifier_without_template(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where it was a remark in the token line, it is now one error line and exit 2."""
    monkeypatch.setattr(support, "CACHE", tmp_path / "vllm_classes.json")
    folder = char_tokenizer(tmp_path / "v", None)
    fake_verifier(folder, LLAMA)
    argv = ["plan", "--params", str(TINY_LLAMA)]
    assert main([*argv, "--verifier-config", str(folder), "--tokens", "1000"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{folder}: no chat template" in err
    (folder / "chat_template.jinja").write_text(TEMPLATE)
    assert main([*argv, "--verifier-config", str(folder), "--tokens", "1000"]) == 0
    out = capsys.readouterr().out
    assert "template    chat_template.jinja: renders a conversation" in out
    assert "vLLM        " in out and "LlamaForCausalLM (model registry) implements" in out
