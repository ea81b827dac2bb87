"""Every assistant turn regenerated: turn k's context is the verifier's own earlier answers."""

from __future__ import annotations

from eagle3_pipeline.conversations import turns

CONV = {
    "id": "c1",
    "split": "train",
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "u1"},
        {"role": "assistant", "content": "dataset a1"},
        {"role": "user", "content": "u2"},
        {"role": "assistant", "content": "dataset a2"},
        {"role": "user", "content": "u3"},
    ],
}


def test_turn_k_has_the_verifiers_answers_as_context() -> None:
    assert turns.turn_count(CONV) == 3
    first = turns.turn_row(CONV, 1, {})
    assert first is not None and first["id"] == "c1.turn1"
    assert [m["content"] for m in first["messages"]] == ["Be brief.", "u1"]
    answers = {"c1.turn1": {"content": "own a1"}, "c1.turn2": {"content": "own a2"}}
    third = turns.turn_row(CONV, 3, answers)
    assert third is not None and third["id"] == "c1.turn3" and third["split"] == "train"
    assert [(m["role"], m["content"]) for m in third["messages"]] == [
        ("system", "Be brief."),
        ("user", "u1"),
        ("assistant", "own a1"),
        ("user", "u2"),
        ("assistant", "own a2"),
        ("user", "u3"),
    ]
    assert turns.turn_row(CONV, 3, {"c1.turn1": {"content": "own a1"}}) is None  # turn 2 failed


def test_single_turn_and_tool_conversations_are_answered_once_as_they_are() -> None:
    single = {"id": "s", "messages": [{"role": "user", "content": "hi"}]}
    assert turns.turn_count(single) == 1 and turns.turn_row(single, 1, {}) is single
    tool = {
        "id": "t",
        "messages": [
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "w"}}]},
            {"role": "tool", "content": "18 C"},
            {"role": "user", "content": "and tomorrow?"},
        ],
    }
    assert turns.turn_count(tool) == 1 and turns.turn_row(tool, 1, {}) is tool
