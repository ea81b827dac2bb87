"""Prompt rows in the shapes chat datasets are published in -> our rows `{id, messages[, tools]}`.

Shapes, by the field that holds the conversation (the first present wins):

- `messages`: OpenAI chat (system/user/assistant/tool turns, text content parts, assistant
  `tool_calls`, a row-level `tools` list or JSON string); UltraChat (`prompt`, `prompt_id` beside).
- `conversations` / `conversation`: ShareGPT/Vicuna `{from, value}` turns (`human`, `gpt`,
  `system`; extra keys such as `weight` or `markdown` ignored), as in Magpie and OpenHermes-2.5;
  turns written `{role, content}` are read too (LMSYS-Chat, WildChat).
- `instruction` (+ `input`, `output`, `system`): Alpaca.
- `prompt` (a string, + `system`): one user turn.

Keys we do not know are dropped; known optional keys appear only when present, so plain rows come
out exactly as they went in.

A row's last turn is the one the verifier answers, so it must be a user or tool turn. A trailing
assistant turn (ShareGPT's and Alpaca's `output`) is refused, or with
`trailing_assistant="regenerate"` dropped: the verifier writes its own answer in its place.
Earlier assistant turns stay as context (never supervised).

Ids: the row's `id_field` when given; else `id`, or the dataset's own id field (ID_FIELDS); else
one derived from the conversation itself (`conv-` + 20 hex digits of the sha256 of its canonical
JSON), the same on every machine and in any row order. Any non-empty string or integer is an id
(`sharegpt/12345`, UUIDs, non-ASCII: store/names.py makes file names of them).

A row that cannot be used raises `Unusable` (a DataError) with a short `reason` that prepare counts
("empty", "assistant-first", ...): prepare skips and lists such rows. A file whose first row has no
known shape is not a prompt set: `unknown_shape` says so in one line.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

from eagle3_pipeline.conversations.prompt_files import Where, prompt_files, raw_rows
from eagle3_pipeline.core.errors import DataError

TrailingAssistant = Literal["refuse", "regenerate"]
ROLES = ("system", "user", "assistant", "tool")
ROLE_ALIASES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "model": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "assistant": "assistant",
    "tool": "tool",
    "observation": "tool",
}
# Dataset id fields tried after `id`, in order (UltraChat, Magpie, LMSYS-Chat, MT-Bench, ...).
ID_FIELDS = ("id", "prompt_id", "uuid", "conversation_id", "question_id", "idx")
DERIVED_ID_PREFIX = "conv-"
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")  # Unicode category Cc
_SURROGATE = re.compile("[\ud800-\udfff]")
SHAPES = (
    "'messages' (OpenAI chat, UltraChat)",
    "'conversations' or 'conversation' (ShareGPT, Magpie, OpenHermes)",
    "'instruction' (Alpaca)",
    "'prompt' (a string)",
)


class Unusable(DataError):  # noqa: N818 (a row, not a failure of the program)
    """One row prepare cannot use; `reason` is the short name it is counted under."""

    def __init__(self, where: object, reason: str, detail: str) -> None:
        super().__init__(f"{where}: {detail}")
        self.where, self.reason, self.detail = where, reason, detail


def unknown_shape(row: Any, where: object) -> DataError:
    """The one-line error for a file whose rows have no shape we know."""
    return DataError(
        f"{where}: rows of an unknown shape ({_found(row)}): accepted are rows with "
        f"{'; '.join(SHAPES)}: convert the file, or rename its conversation field to 'messages'"
    )


def _found(row: Any) -> str:
    if not isinstance(row, dict):
        return f"a JSON {_kind(row)}, not an object"
    keys = [k if k.isprintable() and len(k) <= 40 else repr(k)[:40] for k in map(str, row)]
    return (
        "keys: " + ", ".join(keys[:20]) + (f", ... ({len(keys)} in all)" if len(keys) > 20 else "")
    )


def _kind(value: Any) -> str:
    return {dict: "object", list: "array", str: "string", type(None): "null"}.get(
        type(value), type(value).__name__
    )


def has_shape(row: Any) -> bool:
    """Whether `row` holds a conversation in one of the SHAPES (usable or not)."""
    if not isinstance(row, dict):
        return False
    fields = ("messages", "conversations", "conversation", "instruction")
    return any(row.get(k) is not None for k in fields) or isinstance(row.get("prompt"), str)


def id_problem(value: Any) -> str | None:
    """Why `value` cannot be a sample id (None: it can)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return None
    if not isinstance(value, str) or not value.strip():
        return f"must be a non-empty string (got {value!r:.80})"
    if (control := _CONTROL.search(value)) is not None:
        return f"{value!r:.80} holds the control character U+{ord(control.group()):04X}"
    if _SURROGATE.search(value):
        return f"{value!r:.80} is not valid Unicode (a lone surrogate)"
    return None


def derived_id(messages: list[dict], tools: list[dict]) -> str:
    """`conv-<20 hex>`: the sha256 of the conversation's canonical JSON (sorted keys, ASCII)."""
    canonical = json.dumps(
        {"messages": messages, "tools": tools}, sort_keys=True, separators=(",", ":")
    )
    return DERIVED_ID_PREFIX + hashlib.sha256(canonical.encode()).hexdigest()[:20]


def is_derived_id(sample_id: str) -> bool:
    return sample_id.startswith(DERIVED_ID_PREFIX) and len(sample_id) == len(DERIVED_ID_PREFIX) + 20


def normalize(
    row: Any,
    where: object,
    trailing_assistant: TrailingAssistant = "refuse",
    id_field: str | None = None,
) -> dict:
    """One row of any accepted shape -> `{id, messages[, tools]}`, or Unusable naming `where`."""
    if not isinstance(row, dict):
        raise Unusable(where, "not-an-object", f"row is a JSON {_kind(row)}, not an object")
    explicit = _explicit_id(row, where, id_field)
    messages = _messages(row, where)
    if not messages:
        raise Unusable(where, "empty", "empty conversation (no turns)")
    roles = [m["role"] for m in messages]
    if "user" not in roles:
        raise Unusable(
            where, "no-user-turn", f"no user turn (roles: {', '.join(sorted(set(roles)))})"
        )
    first = next(r for r in roles if r != "system")
    if first != "user":
        raise Unusable(
            where,
            f"{first}-first",
            f"the first turn after the system prompt is the {first}'s, not the user's",
        )
    if roles[-1] == "assistant":
        if trailing_assistant == "refuse":
            raise Unusable(
                where,
                "trailing-assistant",
                "ends with an assistant turn: remove it, or set prepare.trailing_assistant: "
                "regenerate (the verifier then answers in its place)",
            )
        messages = messages[:-1]
    if messages[-1]["role"] not in ("user", "tool"):
        raise Unusable(
            where, "no-final-user-turn", "must end with a user or tool turn for the verifier"
        )
    tools = _tools(row.get("tools"), where)
    sample_id = explicit if explicit is not None else derived_id(messages, tools)
    out: dict[str, Any] = {"id": sample_id, "messages": messages}
    if tools:
        out["tools"] = tools
    return out


def _explicit_id(row: dict, where: object, id_field: str | None) -> str | None:
    """The row's own id (None: derive one); `id_field` must be present when named."""
    for field in (id_field,) if id_field else ID_FIELDS:
        value = row.get(field)
        if value is None and not id_field:
            continue  # parquet gives absent fields as None
        if (problem := id_problem(value)) is not None:
            fix = "fix it" if id_field else "fix it, or name another field in prepare.id_field"
            raise Unusable(where, "bad-id", f"field {field!r} {problem}: {fix}")
        return str(value)
    return None


def _messages(row: dict, where: object) -> list[dict]:
    for key in ("messages", "conversations", "conversation"):
        if row.get(key) is not None:
            turns = row[key]
            if not isinstance(turns, list):
                raise Unusable(where, "bad-turns", f"field {key!r} is not a list of turns")
            return [_message(t, where, key) for t in turns]
    if row.get("instruction") is not None:
        return _alpaca(row, where)
    if isinstance(row.get("prompt"), str):
        system = [_text("system", row["system"])] if row.get("system") else []
        return [*system, _text("user", row["prompt"])] if row["prompt"].strip() else []
    raise Unusable(where, "unknown-shape", f"no conversation field ({_found(row)})")


def _text(role: str, content: str) -> dict:
    return {"role": role, "content": content}


def _alpaca(row: dict, where: object) -> list[dict]:
    instruction, extra = row.get("instruction"), row.get("input")
    if not isinstance(instruction, str) or not isinstance(extra or "", str):
        raise Unusable(where, "bad-content", "fields 'instruction' and 'input' must be strings")
    if not instruction.strip():
        return []
    user = f"{instruction}\n\n{extra}" if extra and extra.strip() else instruction
    out = [_text("system", row["system"])] if isinstance(row.get("system"), str) else []
    out.append(_text("user", user))
    if isinstance(row.get("output"), str) and row["output"]:
        out.append(_text("assistant", row["output"]))
    return out


def _message(m: Any, where: object, key: str) -> dict:
    if not isinstance(m, dict):
        raise Unusable(where, "bad-turns", f"field {key!r} has a turn that is not an object")
    sharegpt = m.get("role") is None and m.get("from") is not None
    name = m.get("from") if sharegpt else m.get("role")
    role = ROLE_ALIASES.get(name.lower() if isinstance(name, str) else name)
    if role is None:
        raise Unusable(
            where,
            "unknown-role",
            f"field {key!r} has a turn with role {name!r:.60}: known roles are "
            f"{', '.join(ROLE_ALIASES)}",
        )
    out: dict[str, Any] = {"role": role, "content": m.get("value" if sharegpt else "content")}
    calls = m.get("tool_calls")
    if calls:
        if role != "assistant":
            raise Unusable(
                where, "bad-tool-call", f"'tool_calls' on a {role} turn: only assistant turns"
            )
        out["tool_calls"] = [_tool_call(c, where) for c in calls]
    if out["content"] is None and "tool_calls" in out:
        out["content"] = ""
    out["content"] = _content(out["content"], where)
    for k in ("tool_call_id", "name"):
        if role == "tool" and isinstance(m.get(k), str):
            out[k] = m[k]
    return out


def _content(content: Any, where: object) -> str | list[dict]:
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content:
        raise Unusable(
            where,
            "bad-content",
            f"a turn's content is a JSON {_kind(content)}: it must be a string or text parts",
        )
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            raise Unusable(
                where,
                "bad-content",
                f"content part of type {kind!r}: only text parts "
                "({'type': 'text', 'text': str}) are supported",
            )
        parts.append({"type": "text", "text": part["text"]})
    return parts


def _tool_call(call: Any, where: object) -> dict:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise Unusable(
            where,
            "bad-tool-call",
            "a tool call must be {'type': 'function', 'function': {'name': str, 'arguments': ...}}",
        )
    out: dict[str, Any] = {"type": "function", "function": {"name": fn["name"]}}
    if isinstance(call.get("id"), str):
        out = {"id": call["id"], **out}
    args = fn.get("arguments")
    # Templates differ in what they expect; the OpenAI API sends a JSON string: so do we.
    out["function"]["arguments"] = args if isinstance(args, str) else json.dumps(args or {})
    return out


def _tools(tools: Any, where: object) -> list[dict]:
    if tools is None or tools == "" or tools == []:
        return []
    if isinstance(tools, str):  # ShareGPT exports often hold the list as a JSON string
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError:
            raise Unusable(where, "bad-tools", "field 'tools' is a string but not JSON") from None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise Unusable(
            where, "bad-tools", "field 'tools' must be a list of tool definitions (objects)"
        )
    return tools


def read(
    source: Path,
    trailing_assistant: TrailingAssistant = "refuse",
    id_field: str | None = None,
) -> Iterator[tuple[Where, dict | Unusable]]:
    """(where, normalized row or the reason it is unusable) for every row, streamed, in file
    order. A file whose first row has no known shape raises `unknown_shape` (and a file that is
    not readable, prompt_files' DataError): those are not prompt sets."""
    for path in prompt_files(source):
        first = True
        for where, raw in raw_rows(path):
            if first and not has_shape(raw):
                raise unknown_shape(raw, where)
            first = False
            try:
                yield where, normalize(raw, where, trailing_assistant, id_field)
            except Unusable as exc:
                yield where, exc


def load(
    source: Path,
    trailing_assistant: TrailingAssistant = "refuse",
    id_field: str | None = None,
) -> list[dict]:
    """The usable rows of a prompt set, in memory, each id once (the first row kept): what
    prepare keeps, before its split and cap. For estimates (the plan); prepare itself streams."""
    rows: list[dict] = []
    seen: set[str] = set()
    for _, row in read(source, trailing_assistant, id_field):
        if isinstance(row, dict) and row["id"] not in seen:
            seen.add(row["id"])
            rows.append(row)
    return rows
