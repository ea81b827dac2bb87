"""Rendering with templates the pipeline did not write; the completion as the model emitted it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from templates import CHATML_DEFAULT_SYSTEM, CHATML_TOOLS, KIMI_MODEL_OPENS_THINK

from eagle3_pipeline.conversations import chat_template
from eagle3_pipeline.conversations.generation_rows import split_reasoning
from eagle3_pipeline.core.errors import DataError
from eagle3_pipeline.stages.tokenize import tokenize_row

AGENTIC = {
    "id": "agent-1",
    "tools": [
        {
            "type": "function",
            "function": {"name": "get_weather", "description": "Weather for a city"},
        }
    ],
    "messages": [
        {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "content": "18 C, clear", "tool_call_id": "c1"},
    ],
}
PLAIN = {"id": "p", "messages": [{"role": "user", "content": "What is the sun made of?"}]}


@pytest.fixture(scope="module")
def tokenizer(tiny_verifier_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_verifier_dir))


def _with(tokenizer, template: str):
    tok = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    tok.chat_template = template
    return tok


def test_plain_rows_render_as_before(tokenizer) -> None:
    want = tokenizer.apply_chat_template(
        PLAIN["messages"], tokenize=False, add_generation_prompt=True, thinking=True
    )
    assert chat_template.render_prompt(tokenizer, PLAIN, {"thinking": True}) == want
    assert want.endswith(chat_template.THINK_START)  # the prompt opens the reasoning


def test_template_with_tools_renders_the_agentic_row(tokenizer) -> None:
    text = chat_template.render_prompt(_with(tokenizer, CHATML_TOOLS), AGENTIC, {})
    assert "get_weather: Weather for a city" in text and "Weather in Paris?" in text
    assert "<tool_call>get_weather {}</tool_call>" in text and "18 C, clear" in text
    assert text.endswith("<|im_start|>assistant")


def test_default_system_template_refuses_what_it_cannot_show(tokenizer) -> None:
    tok = _with(tokenizer, CHATML_DEFAULT_SYSTEM)
    text = chat_template.render_prompt(tok, PLAIN, {})
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named Tiny.")
    assert not text.rstrip().endswith(chat_template.THINK_START)
    with pytest.raises(DataError, match="^sample 'agent-1': the verifier's chat template cannot"):
        chat_template.render_prompt(tok, AGENTIC, {})  # str + list: the template raises
    tools_only = AGENTIC | {"messages": [{"role": "user", "content": "Weather in Paris?"}]}
    with pytest.raises(DataError, match="drops 'get_weather'"):
        chat_template.render_prompt(tok, tools_only, {})


def test_template_that_prints_parts_as_a_list_is_refused(tokenizer) -> None:
    row = {"id": "x", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    with pytest.raises(DataError, match="prints content parts as a list"):
        chat_template.render_prompt(tokenizer, row, {"thinking": True})


def _emitted(tokenizer, emitted_text: str, finish: str) -> tuple[list[int], dict]:
    """The ids a model emitted, and the row generate writes from them and the parser's view."""
    ids = tokenizer(emitted_text, add_special_tokens=False)["input_ids"]
    text = tokenizer.decode(ids, skip_special_tokens=False).removesuffix(tokenizer.eos_token)
    # Before the parser: a prompt that opened <think> makes the whole reply start inside it.
    reasoning, content = split_reasoning(text)
    row = {"id": "r", "split": "train", "messages": PLAIN["messages"]}
    return ids, row | {
        "reasoning": reasoning,
        "content": content,
        "finish_reason": finish,
        "completion_token_ids": ids,
    }


@pytest.mark.parametrize(
    ("template", "emitted", "finish"),
    [
        (None, "The sun is hot.</think>It is plasma.<|im_end|>", "stop"),
        (KIMI_MODEL_OPENS_THINK, "<think>The sun is hot.</think>It is plasma.<|im_end|>", "stop"),
        (KIMI_MODEL_OPENS_THINK, "<think>The sun is hot and it", "length"),
        (None, "The sun is hot and it", "length"),
    ],
)
def test_completion_is_what_the_model_emitted(
    tokenizer, template: str | None, emitted: str, finish: str
) -> None:
    tok = _with(tokenizer, template) if template else tokenizer
    prompt = chat_template.render_prompt(tok, PLAIN, {"thinking": True})
    prompt_ids = tok(prompt, add_special_tokens=False)["input_ids"]
    ids, row = _emitted(tok, emitted, finish)
    out = tokenize_row(tok, row | {"prompt_token_ids": prompt_ids}, 4096, {"thinking": True})
    assert out["input_ids"] == prompt_ids + ids
    assert out["loss_mask"] == [0] * len(prompt_ids) + [1] * len(ids)


def test_emitted_ids_are_kept_where_the_text_would_tokenize_otherwise(tokenizer) -> None:
    """A model may emit a split its tokenizer would never make from the text (' p' + 'r' where
    the text tokenizes as ' pr'): the drafter must learn the split the verifier emitted."""
    text = " pr"
    canonical = tokenizer(text, add_special_tokens=False)["input_ids"]
    pieces = [tokenizer.convert_tokens_to_ids(t) for t in ("Ġp", "r")]
    assert len(canonical) == 1 and pieces != canonical and None not in pieces
    assert tokenizer.decode(pieces) == tokenizer.decode(canonical) == text
    ids = pieces + [tokenizer.eos_token_id]
    row = {
        "id": "r",
        "split": "train",
        "messages": PLAIN["messages"],
        "reasoning": None,
        "content": text,
        "finish_reason": "stop",
        "completion_token_ids": ids,
    }
    prompt = chat_template.render_prompt(tokenizer, PLAIN, {"thinking": True})
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    out = tokenize_row(tokenizer, row, 4096, {"thinking": True})
    assert out["input_ids"] == prompt_ids + ids


def test_a_prompt_the_server_tokenized_otherwise_is_refused(tokenizer) -> None:
    ids, row = _emitted(tokenizer, "It is plasma.<|im_end|>", "stop")
    prompt = chat_template.render_prompt(tokenizer, PLAIN, {"thinking": True})
    served = tokenizer(prompt, add_special_tokens=False)["input_ids"][:-1]
    with pytest.raises(DataError, match=r"sample 'r': the server tokenized the prompt otherwise"):
        tokenize_row(tokenizer, row | {"prompt_token_ids": served}, 4096, {"thinking": True})
    with pytest.raises(DataError, match="no completion_token_ids"):
        tokenize_row(tokenizer, row | {"completion_token_ids": None}, 4096, {"thinking": True})


def test_generated_rows_carry_tools_to_tokenize(tokenizer) -> None:
    tok = _with(tokenizer, CHATML_TOOLS)
    row = json.loads(json.dumps(AGENTIC)) | {
        "split": "train",
        "reasoning": None,
        "content": "It is 18 C.",
        "finish_reason": "stop",
        "completion_token_ids": tok("It is 18 C.<|im_end|>", add_special_tokens=False)["input_ids"],
    }
    out = tokenize_row(tok, row, 4096, {})
    text = tokenizer.decode(out["input_ids"])
    assert "get_weather: Weather for a city" in text and text.endswith("It is 18 C.<|im_end|>")
