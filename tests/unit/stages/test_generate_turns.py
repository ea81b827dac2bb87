"""generate.turns: every — a 3-turn conversation gives 3 supervised rows, asked in rounds."""

from __future__ import annotations

from pathlib import Path

from builders import stand_in_verifier
from fake_openai import fake_servers, reply
from generate_workspace import output_rows, vllm_params

from eagle3_pipeline.core import atomic
from eagle3_pipeline.stages import generate


def test_every_turn_is_answered_with_the_verifiers_own_context(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    conv = [
        {"role": "user", "content": "u1"},
        {"role": "assistant", "content": "dataset a1"},
        {"role": "user", "content": "u2"},
        {"role": "assistant", "content": "dataset a2"},
        {"role": "user", "content": "u3"},
    ]
    atomic.write_jsonl(tmp_path / "data/prepared/train.jsonl", [{"id": "c", "messages": conv}])
    atomic.write_jsonl(
        tmp_path / "data/prepared/val.jsonl",
        [{"id": "v", "messages": [{"role": "user", "content": "only"}]}],
    )
    verifier = stand_in_verifier(tmp_path)
    seen: list[list[str]] = []

    def answer(body: dict) -> tuple[int, dict]:
        said = [m["content"] for m in body["messages"]]
        seen.append(said)
        return reply(None, f"own answer to {said[-1]}", "stop", token_ids=[len(seen)])

    with fake_servers() as start:
        server = start(answer)
        generate.run(vllm_params(verifier, server_url=server.url, turns="every", concurrency=1))
    rows = {r["id"]: r for r in output_rows(tmp_path)}
    assert sorted(rows) == ["c.turn1", "c.turn2", "c.turn3", "v"]
    assert [m["content"] for m in rows["c.turn3"]["messages"]] == [
        "u1",
        "own answer to u1",
        "u2",
        "own answer to u2",
        "u3",
    ]
    assert rows["c.turn2"]["content"] == "own answer to u2" and rows["v"]["split"] == "val"
    assert sorted(len(s) for s in seen) == [1, 1, 3, 5]  # turn 1 of both, then turns 2 and 3
