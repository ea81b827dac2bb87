"""Prompt rows in the shapes chat datasets are published in, from json/jsonl/parquet files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eagle3_pipeline.conversations import prompt_files
from eagle3_pipeline.conversations.formats import Unusable, normalize, read
from eagle3_pipeline.core.errors import DataError

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures/prompts"

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


def load(source: Path, **kw) -> list[dict]:
    """The usable rows of a prompt set (prepare dedups and splits them)."""
    return [row for _, row in read(source, **kw) if not isinstance(row, Unusable)]


def skipped(source: Path, **kw) -> list[tuple[str, str]]:
    """(where, reason) of every unusable row."""
    return [(str(w), row.reason) for w, row in read(source, **kw) if isinstance(row, Unusable)]


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
    with pytest.raises(Unusable, match="line 3: ends with an assistant turn") as err:
        normalize(row, "f: line 3")
    assert err.value.reason == "trailing-assistant"
    assert "prepare.trailing_assistant: regenerate" in str(err.value)
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
        ({"id": "a", "conversations": [{"from": "robot", "value": "x"}]}, "role 'robot': known"),
        ({"id": "a", "text": "hello"}, "no conversation field (keys: id, text)"),
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
        ({"id": "a", "messages": [{"role": "bot", "content": "x"}]}, "known roles are system,"),
    ],
)
def test_bad_rows_name_the_field(row: dict, expected: str) -> None:
    with pytest.raises(Unusable, match="^f: line 9: ") as err:
        normalize(row, "f: line 9")
    assert expected in str(err.value) and isinstance(err.value, DataError)


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
        list(read(f))


def test_json_array_error_names_line(tmp_path: Path) -> None:
    f = tmp_path / "p.json"
    f.write_text('[\n{"id": "a",\n "messages": oops}\n]')
    with pytest.raises(DataError, match=r"p.json: line 3: not valid JSON"):
        list(read(f))


def _row(sid: object) -> str:
    return json.dumps({"id": sid, "messages": [{"role": "user", "content": "hi"}]}) + "\n"


def test_ids_real_datasets_carry_are_accepted(tmp_path: Path) -> None:
    ids = ["sharegpt/12345", "urn:uuid:4f1c2a9e-8b1d-4c1e-9a3b-2f6d7e8c9a01", "prompt-é日本", "a b"]
    (tmp_path / "p.jsonl").write_text("".join(_row(s) for s in [*ids, 17, "ABC", "abc"]))
    assert [r["id"] for r in load(tmp_path / "p.jsonl")] == [*ids, "17", "ABC", "abc"]


def test_every_bad_id_is_skipped_with_its_file_and_line(tmp_path: Path) -> None:
    (tmp_path / "a.jsonl").write_text(
        _row("ok-1") + _row("abc\n") + _row("") + _row("ok-2") + _row(["x"]) + _row("ok-1")
    )
    (tmp_path / "b.jsonl").write_text(_row("tab\there") + _row("   ") + _row(None))
    rows = list(read(tmp_path))
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    bad = {str(w): row.detail for w, row in rows if isinstance(row, Unusable)}
    assert {row.reason for _, row in rows if isinstance(row, Unusable)} == {"bad-id"}
    for where, why in [
        (f"{a}: line 2", "control character U+000A"),
        (f"{a}: line 3", "non-empty string (got '')"),
        (f"{a}: line 5", "non-empty string (got ['x'])"),
        (f"{b}: line 1", "control character U+0009"),
        (f"{b}: line 2", "non-empty string (got '   ')"),
    ]:
        assert why in bad.pop(where), (where, why)
    assert not bad
    # Duplicates are prepare's to count; a null id (parquet's absent field) gets a derived one.
    ids = [row["id"] for _, row in rows if not isinstance(row, Unusable)]
    assert ids[:3] == ["ok-1", "ok-2", "ok-1"] and ids[3].startswith("conv-")


def test_a_lone_surrogate_id_is_skipped(tmp_path: Path) -> None:
    (tmp_path / "p.jsonl").write_text(
        '{"id": "x\\ud800", "messages": [{"role": "user", "content": "q"}]}\n'
    )
    [(where, row)] = read(tmp_path / "p.jsonl")
    assert row.reason == "bad-id" and "is not valid Unicode" in str(row)


# One fixture per shape (tests/fixtures/prompts/, as the datasets are downloaded), read unedited.


def test_openai_chat_with_tools_fixture() -> None:
    rows = load(FIXTURES / "openai-tools.jsonl")
    assert [r["id"] for r in rows] == ["chat-1", "agent-1", "chat-2"]
    assert rows[1]["tools"][0]["function"]["name"] == "get_weather"
    assert rows[1]["messages"][-1]["role"] == "tool"
    assert rows[2]["messages"][1] == {"role": "assistant", "content": "7"}  # context


def test_sharegpt_fixture_extra_keys_empty_and_gpt_first() -> None:
    f = FIXTURES / "sharegpt.json"
    rows = load(f, trailing_assistant="regenerate")
    assert [r["id"] for r in rows] == ["sg-1", "sg-4"]
    assert rows[0]["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
    ]
    assert skipped(f, trailing_assistant="regenerate") == [
        (f"{f}: row 2", "empty"),
        (f"{f}: row 3", "assistant-first"),
    ]


def test_openhermes_fixture_without_ids() -> None:
    rows = load(FIXTURES / "openhermes.json", trailing_assistant="regenerate")
    assert len(rows) == 3 and all(r["id"].startswith("conv-") for r in rows)
    # Rows 2 and 3 ask the same question: once their answers are dropped, the same conversation.
    assert rows[1]["id"] == rows[2]["id"] != rows[0]["id"]


def test_magpie_fixture_takes_uuid() -> None:
    f = FIXTURES / "magpie.jsonl"
    rows = load(f, trailing_assistant="regenerate")
    assert [r["id"] for r in rows] == [
        "0d3b6f5e-1a2b-4c3d-8e9f-000000000001",
        "0d3b6f5e-1a2b-4c3d-8e9f-000000000002",
    ]
    assert rows[0]["messages"] == [{"role": "user", "content": "Explain recursion."}]
    assert skipped(f, trailing_assistant="regenerate") == [(f"{f}: line 3", "unknown-role")]


def test_alpaca_fixture() -> None:
    f = FIXTURES / "alpaca.json"
    rows = load(f, trailing_assistant="regenerate")
    assert [r["messages"] for r in rows] == [
        [{"role": "user", "content": "Give three tips for staying healthy."}],
        [{"role": "user", "content": "Translate to French.\n\nGood morning"}],
        [{"role": "user", "content": "Name a color."}],
    ]
    # Its `output` is an answer written by another model: refused unless regenerated.
    assert [r for _, r in skipped(f)] == ["trailing-assistant", "trailing-assistant"]


def _ultrachat(path: Path, rows: list[dict]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=2)
    return path


def ultrachat_rows(n: int, start: int = 0) -> list[dict]:
    return [
        {
            "prompt": f"question {i}",
            "prompt_id": f"{i:064x}",
            "messages": [
                {"content": f"question {i}", "role": "user"},
                {"content": f"answer {i}", "role": "assistant"},
            ],
        }
        for i in range(start, start + n)
    ]


def test_ultrachat_parquet_takes_prompt_id(tmp_path: Path) -> None:
    f = _ultrachat(tmp_path / "train_sft-00000-of-00001.parquet", ultrachat_rows(5))
    rows = load(f, trailing_assistant="regenerate")
    assert [r["id"] for r in rows] == [f"{i:064x}" for i in range(5)]  # across row groups
    assert rows[4]["messages"] == [{"role": "user", "content": "question 4"}]


def test_folder_of_parquet_shards(tmp_path: Path) -> None:
    for k in range(3):
        _ultrachat(tmp_path / f"train-0000{k}-of-00003.parquet", ultrachat_rows(4, start=4 * k))
    (tmp_path / "README.md").write_text("dataset card")
    where = [w for w, _ in read(tmp_path, trailing_assistant="regenerate")]
    assert [(Path(w.file).name[:11], w.n) for w in where[3:5]] == [
        ("train-00000", 4),
        ("train-00001", 1),
    ]
    assert len(load(tmp_path, trailing_assistant="regenerate")) == 12


def test_id_field_names_the_id(tmp_path: Path) -> None:
    rows = [{"key": f"k{i}", "id": "same", "prompt": f"q{i}"} for i in range(2)]
    f = _jsonl(tmp_path / "p.jsonl", [*rows, {"prompt": "no key"}])
    assert [r["id"] for r in load(f, id_field="key")] == ["k0", "k1"]
    [(where, reason)] = skipped(f, id_field="key")
    assert where.endswith("line 3") and reason == "bad-id"


def test_derived_ids_depend_only_on_the_conversation(tmp_path: Path) -> None:
    rows = [{"messages": [{"role": "user", "content": f"q{i}"}]} for i in range(20)]
    a = [r["id"] for r in load(_jsonl(tmp_path / "a.jsonl", rows))]
    b = [r["id"] for r in load(_jsonl(tmp_path / "b.jsonl", rows[::-1]))]
    assert a == b[::-1] and len(set(a)) == 20
    assert all(len(i) == 25 and i.startswith("conv-") for i in a)
    # The same conversation in another shape has the same id; a system prompt makes another.
    share = {"conversations": [{"from": "human", "value": "q0"}]}
    sys0 = {"messages": [{"role": "system", "content": "s"}, *rows[0]["messages"]]}
    c = [r["id"] for r in load(_jsonl(tmp_path / "c.jsonl", [share, sys0]))]
    assert c[0] == a[0] != c[1]
    assert a[0] == "conv-b463612c8eff2aace4a3"  # the same on every machine and Python version


def test_unknown_shape_is_one_line_naming_the_keys(tmp_path: Path) -> None:
    f = _jsonl(tmp_path / "p.jsonl", [{"text": "hi", "label": 1}])
    with pytest.raises(DataError) as err:
        list(read(f))
    msg = str(err.value)
    assert msg.startswith(f"{f}: line 1: rows of an unknown shape (keys: text, label)")
    assert "'messages' (OpenAI chat" in msg and "'instruction' (Alpaca)" in msg
    assert "\n" not in msg


def test_json_array_streams_across_chunks(tmp_path: Path, monkeypatch) -> None:
    rows = [
        {"id": i, "n": 12345.5, "ok": True, "messages": [{"role": "user", "content": "é" * i}]}
        for i in range(40)
    ]
    f = tmp_path / "p.json"
    f.write_text("\ufeff[\n" + ",\n".join(json.dumps(r, ensure_ascii=False) for r in rows) + "]\n")
    monkeypatch.setattr(prompt_files, "_CHUNK_CHARS", 7)  # every value cut somewhere
    got = list(read(f))
    assert [int(r["id"]) for _, r in got] == list(range(40))
    assert got[-1][1]["messages"][0]["content"] == "é" * 39 and got[-1][0].n == 40
    (tmp_path / "q.json").write_text('[{"prompt": "a"},\n{"prompt": "b"}\n{"prompt": "c"}]')
    with pytest.raises(DataError, match=r"q.json: line 3: not valid JSON \(expected ','"):
        list(read(tmp_path / "q.json"))


def test_json_array_and_bom_edges(tmp_path: Path) -> None:
    f = tmp_path / "p.json"
    f.write_bytes(b'[{"prompt": "a"},\n{"prompt": "\xff"}]')
    with pytest.raises(DataError, match=r"p.json: line 2: not UTF-8 \(byte 0xff"):
        list(read(f))
    (tmp_path / "q.jsonl").write_text('\ufeff{"prompt": "a"}\n')  # a BOM, as some editors write
    assert load(tmp_path / "q.jsonl")[0]["messages"] == [{"role": "user", "content": "a"}]
