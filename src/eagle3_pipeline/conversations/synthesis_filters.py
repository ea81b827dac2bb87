"""Which sampled turns are not prompts: the reasons a synthesized conversation is dropped.

A turn is `truncated` when it was still open at its token limit (no stop string, stop id or end
of sequence), `empty` when fewer than `min_chars` characters are left once stripped, and a
`template_leak` when it holds a piece of the chat template: a role marker (magpie.TurnShape's
markers, e.g. `<|im_start|>user`) or any special or added token of the tokenizer (text is
decoded with special tokens kept, so they show). Checked in that order; the first that applies
is the reason. Exact and near duplicates are near_duplicates.py's.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

TRUNCATED = "truncated"
EMPTY = "empty"
TEMPLATE_LEAK = "template_leak"
DUPLICATE = "duplicate"
NEAR_DUPLICATE = "near_duplicate"
REASONS = (EMPTY, TRUNCATED, TEMPLATE_LEAK, DUPLICATE, NEAR_DUPLICATE)  # stats.json's order


def leak_markers(tokenizer: Any, role_markers: Iterable[str] = ()) -> tuple[str, ...]:
    """Every string whose presence in a turn means the template leaked into it: the template's
    role markers and the tokenizer's special and added tokens (whitespace-only ones excepted:
    some tokenizers add runs of spaces as tokens)."""
    found = set(role_markers) | set(getattr(tokenizer, "all_special_tokens", ()))
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    found |= {getattr(t, "content", str(t)) for t in decoder.values()}
    return tuple(sorted(m for m in found if len(m.strip()) >= 2))


def leaked(text: str, markers: Iterable[str]) -> str | None:
    """The first marker found in `text`, if any."""
    return next((m for m in markers if m in text), None)


def problem(text: str, finished: bool, min_chars: int, markers: Iterable[str]) -> str | None:
    """Why this turn is no prompt (a reason of REASONS), or None when it is one."""
    if not finished:
        return TRUNCATED
    if len(text.strip()) < min_chars:
        return EMPTY
    if leaked(text, markers) is not None:
        return TEMPLATE_LEAK
    return None


def answer_problem(content: str, ended: bool, markers: Iterable[str]) -> str | None:
    """Why an answer between two user turns cannot be their context. It is never trained on:
    one cut at max_answer_tokens still serves; one with nothing left once its reasoning is
    set apart (`empty`, or `truncated` when its reasoning never ended) does not."""
    if not content.strip():
        return EMPTY if ended else TRUNCATED
    if leaked(content, markers) is not None:
        return TEMPLATE_LEAK
    return None
