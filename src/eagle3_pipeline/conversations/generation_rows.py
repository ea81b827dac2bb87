"""The generate stage's rows, the same for both backends: the request a row sends, the
reasoning/answer split as vLLM's parser does it, reproducible per-row seeds, the ids that end a
turn, one row's fields."""

from __future__ import annotations

import hashlib
from typing import Any

from eagle3_pipeline.config.params import GenerateParams
from eagle3_pipeline.conversations import chat_template


def split_reasoning(text: str) -> tuple[str | None, str]:
    """(reasoning, content) of a completion whose prompt opened `<think>`, exactly as vLLM's
    deepseek_r1 parser splits it, so both backends write the same rows.

    A `<think>` the model emits itself restarts the reasoning (what precedes it is dropped);
    without `</think>` the whole text is reasoning that never reached an answer.
    """
    before, start, after = text.partition(chat_template.THINK_START)
    text = after if start else before
    if chat_template.THINK_END not in text:
        return text, ""
    reasoning, _, content = text.partition(chat_template.THINK_END)
    return reasoning, content


def batch_seed(seed: int, ids: list[str]) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{ids[0]}".encode()).digest()[:4], "big")


def row_seed(seed: int, row_id: str) -> int:
    """Sampling seed of one request: reproducible, and independent of which rows share a batch."""
    return batch_seed(seed, [row_id]) & 0x7FFFFFFF


def output_row(
    prepared: dict,
    reasoning: str | None,
    content: str,
    finish_reason: str,
    completion_ids: list[int],
    prompt_ids: list[int] | None,
) -> dict:
    """The output row, the same for both backends. `completion_token_ids` are the ids the
    verifier emitted, the one that ended its turn included: what tokenize trains on, never the
    text re-tokenized (which can split differently, and loses what a reasoning parser strips).
    `prompt_token_ids`: the prompt as the server tokenized it (tokenize checks its own rendering
    against it). `row_key`: the request's key (stages/generate.py), when it has one."""
    tools = {"tools": prepared["tools"]} if prepared.get("tools") else {}
    key = {"row_key": prepared["row_key"]} if "row_key" in prepared else {}
    return {
        "id": prepared["id"],
        "split": prepared["split"],
        "messages": prepared["messages"],
        **tools,
        "reasoning": reasoning,
        "content": content,
        "finish_reason": finish_reason,
        "prompt_token_ids": prompt_ids,
        "completion_token_ids": completion_ids,
        **key,
    }


def end_of_turn_ids(tokenizer, model) -> list[int]:
    """The ids that end a turn: the model's generation config (what vLLM stops on: Kimi ends
    an assistant turn with `<|im_end|>`, not the tokenizer's `[EOS]`), else the tokenizer's eos."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    return list(eos) if isinstance(eos, (list, tuple)) else [int(eos)]


def request_body(g: GenerateParams, seed: int, model: str, row: dict) -> dict[str, Any]:
    """One chat request of the generate stage: its sampling settings (`g`) and a per-row seed
    (`seed`: params' seed).

    `skip_special_tokens: false` keeps `</think>` in the text the reasoning parser splits: when the
    tokenizer marks it special (the tiny verifier's does), vLLM would strip it and report the whole
    answer as reasoning.
    """
    # Tools are rendered into the prompt; the reply stays raw text ("none": no tool parser).
    tools = {"tools": row["tools"], "tool_choice": "none"} if row.get("tools") else {}
    return {
        "model": model,
        "messages": row["messages"],
        **tools,
        "max_tokens": g.max_new_tokens,
        "temperature": g.temperature,
        "top_p": g.top_p,
        "seed": row_seed(seed, row["id"]),
        "chat_template_kwargs": g.chat_template_kwargs,
        "skip_special_tokens": False,
        "return_token_ids": True,  # the ids tokenize trains on (and the prompt's, to check)
    }
