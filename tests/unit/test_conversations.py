"""Prompt rows in the formats users hold: OpenAI chat with tools, ShareGPT, json/jsonl/parquet."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eagle3_pipeline.conversations import load, normalize
from eagle3_pipeline.errors import DataError

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
AGENTIC = {
    "id": "agent-1",
    "tools": TOOLS,
    "messages": [
        {"role": "system", "content": "You are helpful."},
        {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, clear"},
    ],
}


def _jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_plain_rows_come_out_unchanged() -> None:
    row = {"id": "a", "messages": [{"role": "user", "content": "hi"}]}
    assert normalize(dict(row), "f: line 1") == row


def test_openai_agentic_row() -> None:
    out = normalize(AGENTIC, "f: line 1")
    assert out["tools"] == TOOLS
    assert out["messages"][1]["content"] == [{"type": "text", "text": "Weather in Paris?"}]
    call = out["messages"][2]
    assert call["content"] == "" and call["tool_calls"][0]["function"] == {
        "name": "get_weather",
        "arguments": '{"city": "Paris"}',  # the OpenAI API's JSON string
    }
    assert out["messages"][3] == {
        "role": "tool",
        "content": "18 C, clear",
        "tool_call_id": "call_1",
    }


def test_sharegpt_row_and_trailing_answer() -> None:
    row = {
        "id": 7,
        "conversations": [
            {"from": "system", "value": "Be brief."},
            {"from": "human", "value": "2+2?"},
            {"from": "gpt", "value": "4"},
            {"from": "human", "value": "and 3+3?"},
            {"from": "gpt", "value": "6"},
        ],
    }
    with pytest.raises(DataError, match="line 3: field 'messages' must end with a user turn"):
        normalize(row, "f: line 3")
    out = normalize(row, "f: line 3", trailing_assistant="regenerate")
    # The final answer is the verifier's to write; the earlier one stays as context.
    assert out == {
        "id": "7",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4"},
            {"role": "user", "content": "and 3+3?"},
        ],
    }


@pytest.mark.parametrize(
    ("row", "expected"),
    [
        ({"id": "a", "conversations": [{"from": "robot", "value": "x"}]}, "'from': system|human"),
        ({"id": "a", "text": "hello"}, "no 'messages' (OpenAI chat) or 'conversations'"),
        (
            {"id": "a", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "content part of type 'image_url'",
        ),
        (
            {
                "id": "a",
                "messages": [
                    {"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f"}}]}
                ],
            },
            "'tool_calls' on a user turn",
        ),
        (
            {"id": "a", "tools": "{oops", "messages": [{"role": "user", "content": "x"}]},
            "'tools' is a string but not JSON",
        ),
        ({"id": "a", "messages": [{"role": "bot", "content": "x"}]}, "system|user|assistant|tool"),
    ],
)
def test_bad_rows_name_the_field(row: dict, expected: str) -> None:
    with pytest.raises(DataError, match="^f: line 9: ") as err:
        normalize(row, "f: line 9")
    assert expected in str(err.value)


def test_files_of_every_format(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    share = {"id": "s1", "conversations": [{"from": "human", "value": "hi"}]}
    _jsonl(tmp_path / "a.jsonl", [AGENTIC])
    (tmp_path / "b.json").write_text(json.dumps([share]))
    pq.write_table(
        pa.Table.from_pylist([{"id": "p1", "messages": [{"role": "user", "content": "yo"}]}]),
        tmp_path / "c.parquet",
    )
    (tmp_path / "notes.txt").write_text("not a prompt file")
    rows = load(tmp_path)
    assert [r["id"] for r in rows] == ["agent-1", "s1", "p1"]
    assert rows[1]["messages"] == [{"role": "user", "content": "hi"}]
    assert rows[2]["messages"] == [{"role": "user", "content": "yo"}]


def test_parquet_fills_missing_keys_with_none(tmp_path: Path) -> None:
    """Arrow gives every struct every key: absent optional keys come back as None, not data."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    agentic = json.loads(json.dumps(AGENTIC))
    agentic["messages"][1]["content"] = "Weather in Paris?"  # one type per column in parquet
    rows = [
        agentic | {"id": "y", "tools": json.dumps(TOOLS)},
        {"id": "x", "messages": [{"role": "user", "content": "a", "name": None}]},
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    got = load(tmp_path / "d.parquet")
    assert got[0]["tools"] == TOOLS and got[0]["messages"][3]["tool_call_id"] == "call_1"
    assert got[1] == {"id": "x", "messages": [{"role": "user", "content": "a"}]}


def test_undecodable_bytes_name_file_and_line(tmp_path: Path) -> None:
    f = tmp_path / "p.jsonl"
    good = json.dumps({"id": "a", "messages": [{"role": "user", "content": "hi"}]}).encode()
    f.write_bytes(good + b"\n" + b'{"id": "b", "messages": "\xff"}\n')
    with pytest.raises(DataError, match=r"p.jsonl: line 2: not UTF-8 \(byte 0xff at offset"):
        load(f)


def test_json_array_error_names_line(tmp_path: Path) -> None:
    f = tmp_path / "p.json"
    f.write_text('[\n{"id": "a",\n "messages": oops}\n]')
    with pytest.raises(DataError, match=r"p.json: line 3: not valid JSON"):
        load(f)


def _row(sid: object) -> str:
    return json.dumps({"id": sid, "messages": [{"role": "user", "content": "hi"}]}) + "\n"


def test_ids_real_datasets_carry_are_accepted(tmp_path: Path) -> None:
    ids = ["sharegpt/12345", "urn:uuid:4f1c2a9e-8b1d-4c1e-9a3b-2f6d7e8c9a01", "prompt-é日本", "a b"]
    (tmp_path / "p.jsonl").write_text("".join(_row(s) for s in [*ids, 17, "ABC", "abc"]))
    assert [r["id"] for r in load(tmp_path / "p.jsonl")] == [*ids, "17", "ABC", "abc"]


def test_every_bad_id_is_named_with_its_file_and_line(tmp_path: Path) -> None:
    (tmp_path / "a.jsonl").write_text(
        _row("ok-1") + _row("abc\n") + _row("") + _row("ok-2") + _row(["x"]) + _row("ok-1")
    )
    (tmp_path / "b.jsonl").write_text(_row("tab\there") + _row("   ") + _row(None))
    with pytest.raises(DataError) as err:
        load(tmp_path)
    msg = str(err.value)
    assert msg.startswith("7 row(s) with an id that cannot be used: ") and "\n" not in msg
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    for where, why in [
        (f"{a}: line 2", "control character U+000A"),
        (f"{a}: line 3", "non-empty string (got '')"),
        (f"{a}: line 5", "non-empty string (got ['x'])"),
        (f"{a}: line 6", f"duplicate id 'ok-1' (first in {a}: line 1)"),
        (f"{b}: line 1", "control character U+0009"),
        (f"{b}: line 2", "non-empty string (got '   ')"),
        (f"{b}: line 3", "non-empty string (got None)"),
    ]:
        assert f"{where}: " in msg and why in msg, (where, why)


def test_a_lone_surrogate_id_is_refused(tmp_path: Path) -> None:
    (tmp_path / "p.jsonl").write_text(
        '{"id": "x\\ud800", "messages": [{"role": "user", "content": "q"}]}\n'
    )
    with pytest.raises(DataError, match=r"line 1: id .* is not valid Unicode"):
        load(tmp_path / "p.jsonl")
