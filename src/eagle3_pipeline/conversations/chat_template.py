"""Rendering conversations with the verifier's own chat template, as the server renders them.

Rows may carry what not every template can show: text content parts, a `tools` list, assistant
`tool_calls`. A template that cannot render them either raises or silently drops them (a Python
repr of the parts list, no tool names): both are refused here, naming the sample, instead of
training on prompts the server would never see.
"""

from __future__ import annotations

from typing import Any

from eagle3_pipeline.core.errors import DataError

THINK_START = "<think>"
THINK_END = "</think>"


def _must_show(row: dict) -> list[str]:
    """Text that a faithful rendering of the row's non-plain parts contains."""
    pieces = [t["function"]["name"] for t in row.get("tools") or [] if "function" in t]
    for m in row["messages"]:
        if isinstance(m["content"], list):
            pieces += [p["text"] for p in m["content"] if p["text"].strip()]
        pieces += [c["function"]["name"] for c in m.get("tool_calls") or []]
    return pieces


def render_prompt(tokenizer: Any, row: dict, template_kwargs: dict[str, Any]) -> str:
    """The prompt text up to and including the generation prompt of the assistant's turn."""
    kwargs = dict(template_kwargs)
    if row.get("tools"):
        kwargs["tools"] = row["tools"]
    try:
        text = tokenizer.apply_chat_template(
            row["messages"], tokenize=False, add_generation_prompt=True, **kwargs
        )
    except Exception as exc:  # jinja raises its own types, templates raise what they like
        raise DataError(
            f"sample {row['id']!r}: the verifier's chat template cannot render it "
            f"({type(exc).__name__}: {exc}): convert the row (plain string content, no tools) "
            "or use a template that supports it"
        ) from None
    has_parts = any(isinstance(m["content"], list) for m in row["messages"])
    if has_parts and ("'type': 'text'" in text or '"type": "text"' in text):
        raise DataError(
            f"sample {row['id']!r}: the verifier's chat template prints content parts as a list "
            "instead of rendering their text: convert the row to string content or use a "
            "template that renders parts"
        )
    missing = [p for p in _must_show(row) if p not in text]
    if missing:
        raise DataError(
            f"sample {row['id']!r}: the verifier's chat template drops {missing[0]!r} (content "
            "parts, tools or tool calls it does not render): convert the row or use a template "
            "that renders them"
        )
    return text
