"""Prompt rows in the formats users hold -> our conversation rows `{id, messages[, tools]}`.

Accepted, per row: OpenAI chat (`messages` with system/user/assistant/tool turns, text content
parts, assistant `tool_calls`, a row-level `tools` list) and ShareGPT (`conversations` of
`{from, value}`). Files: `.jsonl` (read line by line, so every error names its line), `.json`
(an array of rows, or JSON lines) and `.parquet` (through pyarrow, the reader `datasets` uses).

A row's last turn is the one the verifier answers, so it must be a user or tool turn. A trailing
assistant turn is refused, or with `trailing_assistant="regenerate"` dropped: the verifier writes
its own answer in its place. Earlier assistant turns stay as context (never supervised).
Keys we do not know are dropped; known optional keys appear only when present, so plain rows come
out exactly as they went in.

Ids are data: any non-empty string (or integer) works, `sharegpt/12345`, UUIDs with colons and
non-ASCII included (the store derives a safe file name from it: store/names.py). Refused, with the
file and line of every such row at once: a missing, empty or non-string id, a control character
(a trailing newline), text that is not valid UTF-8, and duplicates.
"""

from __future__ import annotations

import json
import unicodedata
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

from eagle3_pipeline.errors import DataError

TrailingAssistant = Literal["refuse", "regenerate"]
SUFFIXES = (".jsonl", ".json", ".parquet")
ROLES = ("system", "user", "assistant", "tool")
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "tool": "tool",
    "observation": "tool",
}


def prompt_files(source: Path) -> list[Path]:
    if source.is_file():
        return [source]
    if not source.is_dir():
        raise DataError(
            f"{source}: prompt set not found: set prepare.prompts to a file "
            f"({', '.join(SUFFIXES)}) or a directory of them"
        )
    return sorted(f for f in source.iterdir() if f.is_file() and f.suffix in SUFFIXES)


def raw_rows(path: Path) -> Iterator[tuple[str, Any]]:
    """(where, row) for every row of one file; `where` names the file and line or row."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path)
        except Exception as exc:  # pyarrow raises several types for a damaged file
            raise DataError(f"{path}: not a readable parquet file ({exc})") from None
        for n, row in enumerate(table.to_pylist(), 1):
            yield f"{path}: row {n}", row
        return
    data = path.read_bytes()
    if path.suffix == ".json" and data.lstrip()[:1] == b"[":
        try:
            rows = json.loads(_decode(data, f"{path}"))
        except json.JSONDecodeError as exc:
            raise DataError(f"{path}: line {exc.lineno}: not valid JSON ({exc.msg})") from None
        for n, row in enumerate(rows, 1):
            yield f"{path}: row {n}", row
        return
    for n, line in enumerate(data.split(b"\n"), 1):
        where = f"{path}: line {n}"
        text = _decode(line, where)
        if not text.strip():
            continue
        try:
            yield where, json.loads(text)
        except json.JSONDecodeError as exc:
            raise DataError(f"{where}: not valid JSON ({exc.msg})") from None


def _decode(data: bytes, where: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(
            f"{where}: not UTF-8 (byte 0x{data[exc.start]:02x} at offset {exc.start}): "
            "re-encode the file as UTF-8"
        ) from None


def id_problem(value: Any) -> str | None:
    """Why `value` cannot be a sample id (None: it can)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return None
    if not isinstance(value, str) or not value.strip():
        return f"field 'id' must be a non-empty string (got {value!r})"
    for ch in value:
        if unicodedata.category(ch) == "Cc":
            return f"id {value!r} holds the control character U+{ord(ch):04X}"
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return f"id {value!r} is not valid Unicode (a lone surrogate)"
    return None


def normalize(row: Any, where: str, trailing_assistant: TrailingAssistant = "refuse") -> dict:
    """One row in any accepted format -> `{id, messages[, tools]}`, or a DataError at `where`."""
    if not isinstance(row, dict):
        raise DataError(f"{where}: each row must be a JSON object with 'id' and 'messages'")
    if (problem := id_problem(row.get("id"))) is not None:
        raise DataError(f"{where}: {problem}")
    sample_id = str(row["id"])
    if row.get("messages") is not None:
        messages = _openai_messages(row["messages"], where)
    elif row.get("conversations") is not None:
        messages = _sharegpt_messages(row["conversations"], where)
    else:
        raise DataError(
            f"{where}: no 'messages' (OpenAI chat) or 'conversations' (ShareGPT) field in "
            f"row {sample_id!r}"
        )
    if messages and messages[-1]["role"] == "assistant":
        if trailing_assistant == "refuse":
            raise DataError(
                f"{where}: field 'messages' must end with a user turn (id {sample_id}): remove "
                "the final assistant turn, or set prepare.trailing_assistant: regenerate"
            )
        messages = messages[:-1]
    if not messages or messages[-1]["role"] not in ("user", "tool"):
        raise DataError(
            f"{where}: field 'messages' must end with a user turn (id {sample_id}) and hold "
            "at least one"
        )
    out: dict[str, Any] = {"id": sample_id, "messages": messages}
    tools = _tools(row.get("tools"), where)
    if tools:
        out["tools"] = tools
    return out


def _openai_messages(messages: Any, where: str) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: field 'messages' must be a non-empty list of {{role, content}}")
    return [_message(m, where) for m in messages]


def _message(m: Any, where: str) -> dict:
    bad = (
        f"{where}: field 'messages' has an entry that is not "
        "{'role': system|user|assistant|tool, 'content': str or text parts}"
    )
    if not isinstance(m, dict) or m.get("role") not in ROLES:
        raise DataError(bad)
    out: dict[str, Any] = {"role": m["role"], "content": m.get("content")}
    calls = m.get("tool_calls")
    if calls:
        if m["role"] != "assistant":
            raise DataError(f"{where}: 'tool_calls' on a {m['role']} turn: only assistant turns")
        out["tool_calls"] = [_tool_call(c, where) for c in calls]
    if out["content"] is None and "tool_calls" in out:
        out["content"] = ""
    out["content"] = _content(out["content"], where, bad)
    for key in ("tool_call_id", "name"):
        if m["role"] == "tool" and isinstance(m.get(key), str):
            out[key] = m[key]
    return out


def _content(content: Any, where: str, bad: str) -> str | list[dict]:
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content:
        raise DataError(bad)
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            raise DataError(
                f"{where}: content part of type {kind!r}: only text parts "
                "({'type': 'text', 'text': str}) are supported; drop or convert the others"
            )
        parts.append({"type": "text", "text": part["text"]})
    return parts


def _tool_call(call: Any, where: str) -> dict:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise DataError(
            f"{where}: a tool call must be {{'type': 'function', 'function': {{'name': str, "
            "'arguments': ...}}}"
        )
    out: dict[str, Any] = {"type": "function", "function": {"name": fn["name"]}}
    if isinstance(call.get("id"), str):
        out = {"id": call["id"], **out}
    args = fn.get("arguments")
    # Templates differ in what they expect; the OpenAI API sends a JSON string: so do we.
    out["function"]["arguments"] = args if isinstance(args, str) else json.dumps(args or {})
    return out


def _tools(tools: Any, where: str) -> list[dict]:
    if tools is None or tools == "" or tools == []:
        return []
    if isinstance(tools, str):  # ShareGPT exports often hold the list as a JSON string
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError:
            raise DataError(f"{where}: field 'tools' is a string but not JSON") from None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise DataError(f"{where}: field 'tools' must be a list of tool definitions (objects)")
    return tools


def _sharegpt_messages(turns: Any, where: str) -> list[dict]:
    if not isinstance(turns, list) or not turns:
        raise DataError(
            f"{where}: field 'conversations' must be a non-empty list of {{from, value}}"
        )
    out = []
    for turn in turns:
        role = SHAREGPT_ROLES.get(turn.get("from")) if isinstance(turn, dict) else None
        if role is None or not isinstance(turn.get("value"), str):
            raise DataError(
                f"{where}: field 'conversations' has an entry that is not {{'from': "
                f"{'|'.join(SHAREGPT_ROLES)}, 'value': str}}"
            )
        out.append({"role": role, "content": turn["value"]})
    return out


def load(source: Path, trailing_assistant: TrailingAssistant = "refuse") -> list[dict]:
    """Every row of a prompt file or directory, normalized; ids unique across files.

    Bad ids are collected over every file and refused together, each with its file and line.
    """
    rows: list[dict] = []
    seen: dict[str, str] = {}
    bad: list[str] = []
    for f in prompt_files(source):
        for where, raw in raw_rows(f):
            if isinstance(raw, dict) and (problem := id_problem(raw.get("id"))) is not None:
                bad.append(f"{where}: {problem}")
                continue
            row = normalize(raw, where, trailing_assistant)
            if row["id"] in seen:
                bad.append(f"{where}: duplicate id {row['id']!r} (first in {seen[row['id']]})")
                continue
            seen[row["id"]] = where
            rows.append(row)
    if bad:
        raise DataError(
            f"{len(bad)} row(s) with an id that cannot be used: " + "; ".join(bad) + ": give each "
            "row a unique, non-empty id without control characters (any other text works)"
        )
    if not rows:
        raise DataError(
            f"{source}: prompt set is empty: add rows with id and messages ({', '.join(SUFFIXES)})"
        )
    return rows
