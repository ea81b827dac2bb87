"""The reasons a sampled turn is no prompt: truncated, empty, leaking the chat template (a role
marker, or a special or added token of the tokenizer); answers between turns are context."""

from __future__ import annotations

from pathlib import Path

import pytest
from templates import CHATML_DEFAULT_SYSTEM

from eagle3_pipeline.conversations import magpie
from eagle3_pipeline.conversations import synthesis_filters as filters
from eagle3_pipeline.verifier import tiny

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def tokenizer():
    """The tokenizer the tiny verifier stage trains, under a ChatML template with a default
    system prompt (its role markers are no tokens of this tokenizer: text markers)."""
    texts, _ = tiny._read_corpus(REPO / "data/corpus/verifier_corpus.jsonl")
    tok = tiny._train_tokenizer(texts[:60], 400)
    tok.chat_template = CHATML_DEFAULT_SYSTEM
    return tok


@pytest.fixture(scope="module")
def markers(tokenizer) -> tuple[str, ...]:
    return filters.leak_markers(tokenizer, magpie.derive(tokenizer, {}).markers)


def test_markers_are_role_markers_and_the_tokenizers_special_and_added_tokens(
    tokenizer, markers
) -> None:
    assert {"<|im_start|>user", "<|im_start|>assistant", "<|im_end|>"} <= set(markers)
    assert set(tiny.SPECIAL_TOKENS) <= set(markers)  # <think>, <|im_user|>, ...
    assert filters.leak_markers(tokenizer, ["  ", "\n", "x"]) == filters.leak_markers(tokenizer)


@pytest.mark.parametrize(
    ("text", "finished", "reason"),
    [
        ("How do volcanoes form?", True, None),
        ("How do volcanoes form and why do some of them", False, "truncated"),
        ("   ", True, "empty"),
        ("Why?", True, "empty"),  # under min_chars 8
        ("Tell me a joke.<|im_start|>assistant\nSure", True, "template_leak"),
        ("What does <think> mean here?", True, "template_leak"),  # an added token
        ("Explain <|im_user|> please", True, "template_leak"),  # a special token
        ("Use the <b>bold</b> tag, please.", True, None),  # markup that is no marker
    ],
)
def test_turn_problems(markers, text: str, finished: bool, reason: str | None) -> None:
    assert filters.problem(text, finished, 8, markers) == reason


def test_truncation_is_told_first(markers) -> None:
    assert filters.problem("", False, 8, markers) == "truncated"
    assert filters.problem("<|im_end|> and more", False, 8, markers) == "truncated"


def test_answers_between_turns_are_context(markers) -> None:
    assert filters.answer_problem("A long answer cut at the lim", False, markers) is None
    assert filters.answer_problem("", False, markers) == "truncated"  # reasoning never ended
    assert filters.answer_problem(" ", True, markers) == "empty"
    assert filters.answer_problem("ok <|im_start|>user\nhi", True, markers) == "template_leak"
