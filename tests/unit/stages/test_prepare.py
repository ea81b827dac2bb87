"""prepare: stable ids, a split that depends only on the id, unusable rows skipped and listed,
clear errors on bad prompt files."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from eagle3_pipeline.cli import main
from eagle3_pipeline.conversations.formats import Unusable, read
from eagle3_pipeline.core import readers
from eagle3_pipeline.stages.prepare import is_val

REPO = Path(__file__).resolve().parents[3]
FIXTURES = REPO / "tests/fixtures/prompts"


def test_committed_prompt_set() -> None:
    rows = [r for _, r in read(REPO / "data/prompts")]
    assert not [r for r in rows if isinstance(r, Unusable)]
    assert len(rows) >= 200
    assert sum(len(r["messages"]) > 1 for r in rows) >= 20  # multi-turn chats
    val = [r for r in rows if is_val(r["id"], 0.1)]
    assert 0.04 < len(val) / len(rows) < 0.2


def test_split_depends_only_on_id() -> None:
    ids = [f"x{i}" for i in range(1000)]
    first = {i for i in ids if is_val(i, 0.1)}
    assert first == {i for i in reversed(ids) if is_val(i, 0.1)}
    assert 60 < len(first) < 140
    assert first <= {i for i in ids if is_val(i, 0.2)}  # growing val_ratio only adds to val


def _run_prepare(tmp_path: Path, prompts_text: str, capsys, **prepare) -> tuple[int, str]:
    (tmp_path / "data/prompts").mkdir(parents=True)
    (tmp_path / "data/prompts/p.jsonl").write_text(prompts_text)
    return _prepare(tmp_path, capsys, **prepare)[:2]


def _prepare(tmp_path: Path, capsys, **prepare) -> tuple[int, str, str]:
    """`eagle3 prepare` in tmp_path with the default params and `prepare` keys set: (rc, err,
    out)."""
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["prepare"].update(prepare)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        rc = main(["prepare"])
    finally:
        os.chdir(cwd)
    captured = capsys.readouterr()
    return rc, captured.err, captured.out


def _outputs(tmp_path: Path) -> tuple[list[dict], list[dict], list[dict]]:
    out = tmp_path / "data/prepared"
    return tuple(readers.read_jsonl(out / f) for f in ("train.jsonl", "val.jsonl", "skipped.jsonl"))


def test_empty_prompt_set_fails_clearly(tmp_path: Path, capsys) -> None:
    rc, err = _run_prepare(tmp_path, "\n", capsys)
    assert rc == 2 and "prompt set is empty" in err and err.count("\n") == 1
    assert not (tmp_path / "data/prepared").exists()


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("{not json", "line 1: not valid JSON"),
        (json.dumps({"id": "a", "messages": []}), "no usable row (skipped 1: 1 empty): "),
        (
            json.dumps(
                {
                    "id": "a",
                    "messages": [
                        {"role": "user", "content": "hi"},
                        {"role": "assistant", "content": "x"},
                    ],
                }
            ),
            "line 1: ends with an assistant turn",
        ),
    ],
)
def test_malformed_files_and_nothing_usable(
    tmp_path: Path, line: str, expected: str, capsys
) -> None:
    rc, err = _run_prepare(tmp_path, line + "\n", capsys)
    assert rc == 2 and expected in err and "p.jsonl" in err and err.count("\n") == 1
    assert not (tmp_path / "data/prepared").exists()


def test_duplicates_are_kept_once_and_counted(tmp_path: Path, capsys) -> None:
    row = json.dumps({"id": "a", "messages": [{"role": "user", "content": "hi"}]})
    same = json.dumps({"messages": [{"role": "user", "content": "hi"}]})
    rc, _ = _run_prepare(tmp_path, "\n".join([row, same, row, same, same]) + "\n", capsys)
    assert rc == 0
    train, val, skipped = _outputs(tmp_path)
    assert sorted(r["id"] for r in train + val) == ["a", _id()]
    f = "data/prompts/p.jsonl"  # as params name it
    assert skipped == [
        {
            "file": f,
            "line": 3,
            "reason": "duplicate",
            "detail": f"duplicate id 'a' (first in {f}: line 1)",
        },
        {
            "file": f,
            "line": 4,
            "reason": "duplicate",
            "detail": f"the same conversation as {f}: line 2 (id {_id()})",
        },
        {
            "file": f,
            "line": 5,
            "reason": "duplicate",
            "detail": f"the same conversation as {f}: line 2 (id {_id()})",
        },
    ]


def _id() -> str:
    from eagle3_pipeline.conversations.formats import derived_id

    return derived_id([{"role": "user", "content": "hi"}], [])


def test_output_rows(tmp_path: Path, capsys) -> None:
    rows = [{"id": f"q{i}", "messages": [{"role": "user", "content": f"q {i}"}]} for i in range(50)]
    rc, _ = _run_prepare(tmp_path, "".join(json.dumps(r) + "\n" for r in rows), capsys)
    assert rc == 0
    train = readers.read_jsonl(tmp_path / "data/prepared/train.jsonl")
    val = readers.read_jsonl(tmp_path / "data/prepared/val.jsonl")
    assert len(train) + len(val) == 50 and {r["id"] for r in val} == {
        r["id"] for r in rows if is_val(r["id"], 0.1)
    }


def _four_sets(root: Path) -> Path:
    """The issue's four prompt sets, shaped as downloaded, in one folder."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root.mkdir(parents=True)
    ultrachat = [
        {
            "prompt": f"question {i}",
            "prompt_id": f"{i:064x}",
            "messages": [
                {"content": f"question {i}", "role": "user"},
                {"content": f"answer {i}", "role": "assistant"},
            ],
        }
        for i in range(30)
    ]
    pq.write_table(pa.Table.from_pylist(ultrachat), root / "ultrachat.parquet", row_group_size=8)
    for name in ("sharegpt.json", "openhermes.json", "magpie.jsonl"):
        (root / name).write_bytes((FIXTURES / name).read_bytes())
    return root


def test_the_four_public_sets_prepare(tmp_path: Path, capsys) -> None:
    prompts = _four_sets(tmp_path / "sets")
    rc, err, out = _prepare(tmp_path, capsys, prompts=str(prompts), trailing_assistant="regenerate")
    assert rc == 0, err
    summary = "kept 36, skipped 4: 1 unknown-role, 1 empty, 1 assistant-first, 1 duplicate"
    assert f"[prepare] {summary} (listed in data/prepared/skipped.jsonl)" in out
    assert "rows/s" in out
    train, val, skipped = _outputs(tmp_path)
    ids = [r["id"] for r in train + val]
    assert len(ids) == len(set(ids)) == 36
    assert sum(i.startswith("conv-") for i in ids) == 2  # OpenHermes: derived, one duplicate
    assert {"0d3b6f5e-1a2b-4c3d-8e9f-000000000001", f"{7:064x}", "sg-4"} <= set(ids)
    assert [(Path(s["file"]).name, s.get("line", s.get("row")), s["reason"]) for s in skipped] == [
        ("magpie.jsonl", 3, "unknown-role"),
        ("sharegpt.json", 2, "empty"),
        ("sharegpt.json", 3, "assistant-first"),
        ("openhermes.json", 3, "duplicate"),
    ]
    # Stable: a second run in another folder writes the same bytes.
    other = tmp_path / "again"
    other.mkdir()
    assert _prepare(other, capsys, prompts=str(prompts), trailing_assistant="regenerate")[0] == 0
    for name in ("train.jsonl", "val.jsonl", "skipped.jsonl"):
        a = (tmp_path / "data/prepared" / name).read_bytes()
        assert a == (other / "data/prepared" / name).read_bytes(), name


def test_on_unusable_fail_names_the_first_rows_and_the_count(tmp_path: Path, capsys) -> None:
    good = json.dumps({"messages": [{"role": "user", "content": "hi"}]})
    empty = json.dumps({"messages": []})
    rc, err = _run_prepare(
        tmp_path, "\n".join([good] + [empty] * 30) + "\n", capsys, on_unusable="fail"
    )
    assert rc == 2 and err.count("\n") == 1
    assert "skipped 30: 30 empty (prepare.on_unusable: fail): " in err
    assert "p.jsonl: line 21: empty conversation" in err  # the 20th unusable row
    assert "line 22:" not in err and "; ... and 10 more: " in err
    assert "set prepare.on_unusable: skip" in err
    assert not (tmp_path / "data/prepared").exists()


def test_a_folder_of_parquet_shards(tmp_path: Path, capsys) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    shards = tmp_path / "shards"
    shards.mkdir()
    for k in range(3):
        rows = [
            {"id": f"s{k}-{i}", "messages": [{"role": "user", "content": f"q{k}{i}"}]}
            for i in range(10)
        ]
        pq.write_table(pa.Table.from_pylist(rows), shards / f"train-0000{k}-of-00003.parquet")
    rc, err, out = _prepare(tmp_path, capsys, prompts=str(shards))
    assert rc == 0, err
    assert "[prepare] kept 30, skipped 0\n" in out
    train, val, skipped = _outputs(tmp_path)
    assert sorted(r["id"] for r in train + val) == sorted(
        f"s{k}-{i}" for k in range(3) for i in range(10)
    )
    assert skipped == []


def test_rows_sorted_by_id_through_runs_on_disk(tmp_path: Path, monkeypatch, capsys) -> None:
    """More rows than one sort run holds: the output is the same as sorted in memory."""
    from eagle3_pipeline.core import external_sort

    rows = [
        {"id": f"q{(i * 37) % 101}", "messages": [{"role": "user", "content": "x"}]}
        for i in range(101)
    ]
    text = "".join(json.dumps(r) + "\n" for r in rows + rows[:3])
    rc, _ = _run_prepare(tmp_path, text, capsys)
    expected = _outputs(tmp_path)
    real = external_sort.sorted_records
    monkeypatch.setattr(
        external_sort, "sorted_records", lambda recs, scratch: real(recs, scratch, run_bytes=500)
    )
    other = tmp_path / "small-runs"
    rc2, _ = _run_prepare(other, text, capsys)
    assert rc == rc2 == 0 and _outputs(other) == expected
    assert [r["id"] for r in expected[0]] == sorted(r["id"] for r in expected[0])
    assert [s["line"] for s in expected[2]] == [102, 103, 104]


def _given(root: Path, n: int) -> Path:
    """A given prompt file of n rows, outside the workspace."""
    rows = [
        {"id": f"g{i:03d}", "messages": [{"role": "user", "content": f"q {i}"}]} for i in range(n)
    ]
    path = root / "given.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _synthesized(root: Path, n: int, count: int | None = None) -> list[str]:
    """data/synthesized in `root` as the synthesize stage writes it (n rows, made for count)."""
    from eagle3_pipeline.core import atomic
    from eagle3_pipeline.stages.synthesize import conversation_id

    convs = [[{"role": "user", "content": f"synthesized question {i}"}] for i in range(n)]
    rows = [{"id": conversation_id(m), "messages": m} for m in convs]
    atomic.write_jsonl(root / "data/synthesized/prompts.jsonl", rows)
    atomic.write_json(root / "data/synthesized/stats.json", {"count": count or n})
    return [r["id"] for r in rows]


def _taken(root: Path) -> tuple[set[str], set[str]]:
    """(synthesized, given) ids in root's prepared output."""
    train, val, _ = _outputs(root)
    ids = {r["id"] for r in train + val}
    return {i for i in ids if i.startswith("syn-")}, {i for i in ids if not i.startswith("syn-")}


def test_synthesized_prompts_mix_by_share_nested(tmp_path: Path, capsys) -> None:
    from eagle3_pipeline.stages.prepare import mix_rank

    given = _given(tmp_path, 60)
    got, logs = {}, {}
    for share in (None, 0.5, 0.25, 1.0):
        root = tmp_path / f"share-{share}"
        syn_ids = _synthesized(root, 40)
        rc, err, logs[share] = _prepare(
            root, capsys, prompts=str(given), synthesize={"count": 40}, synthesized_share=share
        )
        assert rc == 0, err
        got[share] = _taken(root)
    assert [tuple(map(len, got[s])) for s in (None, 0.5, 0.25, 1.0)] == [
        (40, 60),
        (40, 40),
        (20, 60),
        (40, 0),
    ]
    assert got[None][0] == set(syn_ids)
    assert "[prepare] 40 synthesized + 60 given (prepare.synthesized_share null: all" in logs[None]
    assert (
        "[prepare] 40 synthesized + 40 given (prepare.synthesized_share=0.5: took 40 of 40 "
        "synthesized and 40 of 60 given usable prompts)"
    ) in logs[0.5]
    # each source in its own hash order: a smaller mix is nested in a larger one
    assert got[0.5][1] < got[0.25][1] and got[0.25][0] < got[0.5][0]
    assert got[0.5][1] == set(sorted((f"g{i:03d}" for i in range(60)), key=mix_rank)[:40])


def test_mix_counts() -> None:
    from eagle3_pipeline.conversations.synthesis_mix import mix_counts

    assert mix_counts(40, 60, 0.5) == (40, 40)
    assert mix_counts(300, 120, 0.5) == (120, 120)
    assert mix_counts(100, 1000, 0.25) == (100, 300)
    assert mix_counts(10, 0, 1.0) == (10, 0)
    assert mix_counts(10, 0, 0.5) == (0, 0)
    for syn, given, share in [(7, 13, 0.3), (1000, 999, 0.9), (3, 3, 0.01)]:
        s, g = mix_counts(syn, given, share)
        assert s <= syn and g <= given and abs(s - share * (s + g)) <= 1


def test_with_share_one_the_given_files_are_not_read(tmp_path: Path, capsys) -> None:
    given = tmp_path / "given.jsonl"
    given.write_text(json.dumps({"id": "a", "messages": []}) + "\n")  # no usable row
    syn_ids = _synthesized(tmp_path, 12)
    rc, err, out = _prepare(
        tmp_path, capsys, prompts=str(given), synthesize={"count": 12}, synthesized_share=1.0
    )
    assert rc == 0, err
    assert _taken(tmp_path) == (set(syn_ids), set())
    assert _outputs(tmp_path)[2] == []  # nothing read from the given file, nothing skipped


def test_count_zero_leaves_prepare_as_it_was(tmp_path: Path, capsys) -> None:
    """A synthesized set on disk is not read with count 0: the same bytes as without it."""
    given = _given(tmp_path, 30)
    plain, stale = tmp_path / "plain", tmp_path / "stale"
    plain.mkdir()
    _synthesized(stale, 5)
    for root in (plain, stale):
        assert _prepare(root, capsys, prompts=str(given))[0] == 0
    for name in ("train.jsonl", "val.jsonl", "skipped.jsonl"):
        a = (plain / "data/prepared" / name).read_bytes()
        assert a == (stale / "data/prepared" / name).read_bytes(), name


@pytest.mark.parametrize(
    ("synthesized", "prepare", "expected"),
    [
        (None, {"synthesize": {"count": 5}}, "prompts.jsonl: not found: run the synthesize stage"),
        (
            3,
            {"synthesize": {"count": 5}},
            "holds prompts for prepare.synthesize.count=3, params say 5: run the synthesize",
        ),
        (
            None,
            {"synthesized_share": 0.5},
            "prepare.synthesized_share is 0.5 but prepare.synthesize.count is 0",
        ),
        (
            5,
            {"synthesize": {"count": 5}, "synthesized_share": 0.5, "prompts": "EMPTY"},
            "prepare.synthesized_share=0.5 takes no prompt from 5 synthesized and 0 given",
        ),
    ],
    ids=["not-synthesized", "stale", "share-without-count", "nothing-given"],
)
def test_synthesized_source_errors_in_one_line(
    tmp_path: Path, capsys, synthesized: int | None, prepare: dict, expected: str
) -> None:
    if synthesized is not None:
        _synthesized(tmp_path, synthesized)
    if prepare.get("prompts") == "EMPTY":
        prepare["prompts"] = str(tmp_path / "given.jsonl")
        (tmp_path / "given.jsonl").write_text(json.dumps({"id": "a", "messages": []}) + "\n")
    rc, err, _ = _prepare(tmp_path, capsys, **prepare)
    assert rc == 2 and expected in err and err.count("\n") == 1, err
    assert not (tmp_path / "data/prepared").exists()
