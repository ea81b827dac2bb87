"""Multi-turn conversations answered turn by turn by the verifier itself (`generate.turns`).

With `every`, a conversation with N user turns becomes N requests, made in rounds: turn k is
asked once the verifier's own answers to turns 1..k-1 are in, and those answers (not the
dataset's assistant turns) are its context. Each turn is one generated row, `<id>.turn<k>`, so a
3-turn conversation gives 3 supervised answers, each trained on exactly the prompt the verifier
saw. Conversations with tool turns keep the dataset's context and are answered once (their last
turn): a regenerated tool call would no longer match the tool results that follow it.
"""

from __future__ import annotations

from typing import Any

TOOL_ROLES = {"tool", "function", "ipython"}


def has_tool_turns(row: dict[str, Any]) -> bool:
    return any(m["role"] in TOOL_ROLES or m.get("tool_calls") for m in row["messages"])


def turn_count(row: dict[str, Any]) -> int:
    """How many requests `every` makes for this conversation (1 for tool conversations)."""
    if has_tool_turns(row):
        return 1
    return max(1, sum(1 for m in row["messages"] if m["role"] == "user"))


def turn_id(row_id: str, k: int) -> str:
    return f"{row_id}.turn{k}"


def turn_row(row: dict[str, Any], k: int, answers: dict[str, dict]) -> dict[str, Any] | None:
    """The request row of turn k (1-based): the conversation up to its k-th user message, with
    every earlier assistant turn replaced by the verifier's own answer from `answers` (generated
    rows by id). None when an earlier turn has no answer (it failed: later turns cannot be asked).
    A conversation answered once keeps its id and messages."""
    if turn_count(row) == 1:
        return row
    messages: list[dict[str, Any]] = []
    users = 0
    for m in row["messages"]:
        if m["role"] == "assistant":
            continue  # the dataset's answers are replaced by the verifier's own
        if m["role"] == "user":
            if users:
                answer = answers.get(turn_id(row["id"], users))
                if answer is None:
                    return None
                messages.append({"role": "assistant", "content": answer["content"]})
            users += 1
        messages.append(m)
        if users == k:
            return row | {"id": turn_id(row["id"], k), "messages": messages}
    return None
