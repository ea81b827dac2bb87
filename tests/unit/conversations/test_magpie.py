"""Magpie's view of a chat template, derived by rendering: the opening of a user turn (after a
default system prompt, after earlier turns), what closes it, the role markers; one-line refusals
of templates it cannot use. Templates as downloaded models ship them (tests/helpers/templates.py)
and the tiny verifier's own, on the tokenizer the tiny verifier stage trains."""

from __future__ import annotations

from pathlib import Path

import pytest
from templates import CHATML_DEFAULT_SYSTEM, CHATML_TOOLS, KIMI_MODEL_OPENS_THINK

from eagle3_pipeline.conversations import magpie
from eagle3_pipeline.core.errors import VerifierError
from eagle3_pipeline.verifier import tiny

REPO = Path(__file__).resolve().parents[3]
# Llama-3's shape (BOS in the template, header tokens, content trimmed).
LLAMA3_LIKE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n"
    "{{ m.content | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
# A plain-text template that writes nothing after the last turn: the next opening closes it.
PLAIN = (
    "{% for m in messages %}{% if m.role == 'user' %}User: {{ m.content }}\n"
    "{% else %}Assistant: {{ m.content }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)
HISTORY = [
    {"role": "user", "content": "What is rain?"},
    {"role": "assistant", "content": "Water falling from clouds."},
]


@pytest.fixture(scope="module")
def tokenizer():
    """The tokenizer the tiny verifier stage trains (its special tokens, its template)."""
    texts, _ = tiny._read_corpus(REPO / "data/corpus/verifier_corpus.jsonl")
    return tiny._train_tokenizer(texts[:60], 400)


def _with(tokenizer, template: str):
    tokenizer.chat_template = template
    return tokenizer


@pytest.mark.parametrize(
    ("template", "kwargs", "opening", "close", "default_system"),
    [
        (
            CHATML_DEFAULT_SYSTEM,
            {},
            "<|im_start|>system\nYou are a helpful AI assistant named Tiny.<|im_end|>\n"
            "<|im_start|>user\n",
            "<|im_end|>",
            True,
        ),
        (CHATML_TOOLS, {}, "<|im_start|>user", "<|im_end|>", False),
        (KIMI_MODEL_OPENS_THINK, {}, "<|im_user|>user<|im_middle|>", "<|im_end|>", False),
        (
            tiny.CHAT_TEMPLATE,
            {"thinking": True},
            "<|im_user|>user<|im_middle|>",
            "<|im_end|>",
            False,
        ),
        (
            LLAMA3_LIKE,
            {},
            "<|endoftext|><|start_header_id|>user<|end_header_id|>\n\n",
            "<|eot_id|>",
            False,
        ),
        (PLAIN, {}, "User: ", "Assistant:", False),
    ],
    ids=["chatml-default-system", "chatml-tools", "kimi", "tiny-verifier", "llama3", "plain"],
)
def test_opening_and_close_of_a_user_turn(
    tokenizer, template: str, kwargs: dict, opening: str, close: str, default_system: bool
) -> None:
    shape = magpie.derive(_with(tokenizer, template), kwargs)
    assert shape.opening == opening
    assert shape.user_close == close
    assert shape.default_system is default_system
    # What the verifier samples after the opening, closed there, is the template's own turn
    # (a template that closes a turn only with the next one's opening: PLAIN).
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hello there"}],
        tokenize=False,
        add_generation_prompt=True,
        **kwargs,
    )
    assert rendered.startswith(opening + "Hello there")
    assert close in rendered[len(opening + "Hello there") :]


def test_a_close_that_is_one_special_token_is_a_stop_id(tokenizer) -> None:
    shape = magpie.derive(_with(tokenizer, tiny.CHAT_TEMPLATE), {"thinking": True})
    assert shape.user_stop_ids == (tokenizer.convert_tokens_to_ids("<|im_end|>"),)
    assert shape.answer_close == "<|im_end|>"
    # `<|eot_id|>` is no token of this tokenizer: only the stop string ends the turn.
    assert magpie.derive(_with(tokenizer, LLAMA3_LIKE), {}).user_stop_ids == ()


def test_role_markers_of_every_role(tokenizer) -> None:
    chatml = magpie.derive(_with(tokenizer, CHATML_DEFAULT_SYSTEM), {})
    assert set(chatml.markers) == {
        "<|im_end|>",
        "<|im_start|>user",
        "<|im_start|>assistant",
        "<|im_start|>system",
    }
    kimi = magpie.derive(_with(tokenizer, tiny.CHAT_TEMPLATE), {"thinking": True})
    assert {"<|im_user|>user<|im_middle|>", "<|im_system|>system<|im_middle|>"} <= set(kimi.markers)


@pytest.mark.parametrize("template", [CHATML_DEFAULT_SYSTEM, KIMI_MODEL_OPENS_THINK, LLAMA3_LIKE])
def test_opening_after_earlier_turns(tokenizer, template: str) -> None:
    tok = _with(tokenizer, template)
    opening = magpie.opening(tok, HISTORY, {})
    full = tok.apply_chat_template(
        [*HISTORY, {"role": "user", "content": "And snow?"}], tokenize=False
    )
    assert full.startswith(opening + "And snow?")
    assert "Water falling from clouds." in opening
    assert opening.startswith(magpie.opening(tok, [], {}))  # the first opening comes first


def test_the_answer_prompt_is_what_generate_renders(tokenizer) -> None:
    tok = _with(tokenizer, tiny.CHAT_TEMPLATE)
    prompt = magpie.answer_prompt(tok, HISTORY[:1], {"thinking": True})
    assert prompt == "<|im_user|>user<|im_middle|>What is rain?<|im_end|>" + (
        "<|im_assistant|>assistant<|im_middle|><think>"
    )


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        (
            "{% for m in messages %}{% if m.role == 'assistant' %}A: {{ m.content }}{% endif %}"
            "{% endfor %}",
            "renders the user's text 0 times, not once",
        ),
        (
            "{% for m in messages %}{{ m.content }} {{ m.content }}{% endfor %}",
            "renders the user's text 2 times, not once",
        ),
        (
            "{% for m in messages %}{% if m.role == 'user' %}"
            "{{ raise_exception('only system and assistant roles') }}{% endif %}{% endfor %}",
            "cannot render a conversation of one user turn",
        ),
        (
            "{% for m in messages %}{{ m.content }}<|im_end|>{% endfor %}",
            "writes nothing before a user's text",
        ),
        (
            "{% for m in messages %}{% if m.role == 'user' %}Q: {% endif %}{{ m.content }}"
            "{% endfor %}",
            "writes nothing after a user's text",
        ),
    ],
    ids=["no-user-role", "twice", "raises", "no-opening", "no-close"],
)
def test_templates_magpie_cannot_use_are_refused_in_one_line(
    tokenizer, template: str, expected: str
) -> None:
    with pytest.raises(VerifierError) as err:
        magpie.derive(_with(tokenizer, template), {})
    assert expected in str(err.value)
    assert "\n" not in str(err.value).replace("\\n", "")
    assert "prepare.synthesize.count: 0" in str(err.value)


def test_cut_and_decode_a_sampled_turn(tokenizer) -> None:
    assert magpie.cut("How tall is it?<|im_end|>junk", ["<|im_end|>"]) == ("How tall is it?", True)
    assert magpie.cut("still going", ["<|im_end|>"]) == ("still going", False)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = tokenizer("Why is the sky blue?", add_special_tokens=False)["input_ids"]
    assert magpie.decode_turn(tokenizer, [*ids, end, 7, 8], [end], ["<|im_end|>"], True) == (
        "Why is the sky blue?",
        True,
    )
    text, ended = magpie.decode_turn(tokenizer, ids, [end], ["<|im_end|>"], False)
    assert (text, ended) == ("Why is the sky blue?", False)
    # special tokens stay in the text: the leak filter must see them
    leak = tokenizer("a<|im_user|>b", add_special_tokens=False)["input_ids"]
    assert magpie.decode_turn(tokenizer, leak, [end], [], True)[0] == "a<|im_user|>b"


def test_answer_content_without_its_reasoning() -> None:
    opened = "<|im_assistant|>assistant<|im_middle|><think>"
    assert magpie.answer_content(opened, "hmm, rain.</think> Water. ") == "Water."
    assert magpie.answer_content(opened, "thinking that never ends") == ""
    assert magpie.answer_content("Assistant:", " Plain answer. ") == "Plain answer."
    assert magpie.answer_content("x", "<think>a</think>b") == "b"  # the model opened it
