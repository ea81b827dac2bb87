"""The Magpie method's view of a chat template: the text that opens a user turn, and what
closes it, derived by rendering, for any template.

A conversation with sentinel words in place of the user's (and the assistant's) is rendered
with the verifier's own template and generate.chat_template_kwargs, and cut at the sentinels:

- the opening of the first user turn is everything before the user's sentinel in a one-turn
  conversation (a default system prompt the template inserts included, as the verifier will
  see it later); after earlier turns, everything before the sentinel of a user turn appended
  to them (`opening`);
- what closes a user turn is what the template writes right after the user's words both when
  the turn is last and when an assistant turn follows (their common start, stripped: ChatML
  `<|im_end|>`, Llama-3 `<|eot_id|>`, Mistral `[/INST]`); the same for an assistant turn;
- the role markers (the openings of each role, the closes) feed the leak filter.

A template that cannot render a user turn, renders its words other than once, opens it with
nothing, or closes it with nothing is refused in one line: Magpie needs all four.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from eagle3_pipeline.conversations import chat_template
from eagle3_pipeline.conversations.generation_rows import split_reasoning
from eagle3_pipeline.core.errors import VerifierError

USER = "MagpieUserSentinelQz7"
USER2 = "MagpieNextUserSentinelQz7"
ASSISTANT = "MagpieAssistantSentinelQz7"
SYSTEM = "MagpieSystemSentinelQz7"
_FIX = "set prepare.synthesize.count: 0 and give prompt files (prepare.prompts)"


@dataclass(frozen=True)
class TurnShape:
    """What the template writes around a user turn, as Magpie needs it."""

    opening: str  # the text before the first user turn's words
    user_close: str  # the stop string that ends a user turn
    user_stop_ids: tuple[int, ...]  # its id, when it is one token of the tokenizer's own
    answer_close: str  # the same for an assistant turn ("" when only end of sequence ends it)
    answer_stop_ids: tuple[int, ...]
    markers: tuple[str, ...]  # role markers: the openings and closes of the template's roles
    system_open: str = ""  # what opens a system turn ("" when the template has no system role)

    @property
    def default_system(self) -> bool:
        """Whether the opening holds a system turn the template inserted by itself."""
        return bool(self.system_open) and self.system_open in self.opening


def _render(tokenizer: Any, messages: list[dict], kwargs: dict[str, Any]) -> str:
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=False, **kwargs
    )


def _where(tokenizer: Any) -> str:
    return f"{getattr(tokenizer, 'name_or_path', '') or 'the verifier'}: the chat template"


def _split(text: str, sentinel: str, what: str, where: str) -> tuple[str, str]:
    n = text.count(sentinel)
    if n != 1:
        raise VerifierError(
            f"{where} renders the {what} {n} times, not once ({text[:120]!r}...): Magpie "
            f"cannot tell where the turn opens and closes: {_FIX}"
        )
    before, _, after = text.partition(sentinel)
    return before, after


def _close(alone: str, followed: str) -> tuple[str, str]:
    """(the close, stripped; what follows it in `followed`): the common start of what the
    template writes after a turn's words when the turn is last (`alone`) and when another turn
    follows (`followed`). A template that writes nothing after a last turn ("User: ...")
    closes it with the next turn's opening."""
    common = os.path.commonprefix([alone, followed])
    if common.strip():
        return common.strip(), followed[len(common) :]
    if alone.strip():
        return alone.strip(), ""
    return followed.strip(), ""


def _single_token_ids(tokenizer: Any, text: str) -> tuple[int, ...]:
    """The id of `text` when it is one added or special token (a stop id vLLM matches before
    detokenizing); empty otherwise (then only the stop string ends the turn)."""
    if not text:
        return ()
    added = {getattr(t, "content", str(t)) for t in (tokenizer.added_tokens_decoder or {}).values()}
    if text not in added and text not in tokenizer.all_special_tokens:
        return ()
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return (ids[0],) if len(ids) == 1 else ()


def derive(tokenizer: Any, template_kwargs: dict[str, Any]) -> TurnShape:
    """The template's user-turn opening and closes, rendered with `template_kwargs`."""
    where = _where(tokenizer)
    user = {"role": "user", "content": USER}
    assistant = {"role": "assistant", "content": ASSISTANT}
    try:
        one = _render(tokenizer, [user], template_kwargs)
    except Exception as exc:  # jinja raises its own types, templates raise what they like
        raise VerifierError(
            f"{where} cannot render a conversation of one user turn ({type(exc).__name__}: "
            f"{exc}): Magpie needs a template with a user role: {_FIX}"
        ) from None
    opening, after_user = _split(one, USER, "user's text", where)
    if not opening.strip():
        raise VerifierError(
            f"{where} writes nothing before a user's text: there is no opening for the verifier "
            f"to continue: {_FIX}"
        )
    try:
        two = _render(tokenizer, [user, assistant], template_kwargs)
        second = {"role": "user", "content": USER2}
        three = _render(tokenizer, [user, assistant, second], template_kwargs)
    except Exception as exc:  # noqa: BLE001
        raise VerifierError(
            f"{where} cannot render a user turn followed by an assistant turn "
            f"({type(exc).__name__}: {exc}): {_FIX}"
        ) from None
    _, rest = _split(two, USER, "user's text", where)
    between_ua, after_answer = _split(rest, ASSISTANT, "assistant's text", where)
    _, rest3 = _split(three, ASSISTANT, "assistant's text", where)
    between_au, _ = _split(rest3, USER2, "second user's text", where)
    user_close, assistant_open = _close(after_user, between_ua)
    if not user_close:
        raise VerifierError(
            f"{where} writes nothing after a user's text: nothing would end a sampled user "
            f"turn: {_FIX}"
        )
    answer_close, user_open = _close(after_answer, between_au)
    system_open = _system_open(tokenizer, template_kwargs)
    # The first user turn's own opening: after the default system turn's close, if any.
    first_open = opening.rsplit(user_close, 1)[-1].strip()
    markers = {user_close, answer_close, assistant_open.strip(), user_open.strip(), first_open}
    return TurnShape(
        opening=opening,
        user_close=user_close,
        user_stop_ids=_single_token_ids(tokenizer, user_close),
        answer_close=answer_close,
        answer_stop_ids=_single_token_ids(tokenizer, answer_close),
        markers=tuple(sorted(m for m in markers | {system_open} if len(m) >= 2)),
        system_open=system_open,
    )


def _system_open(tokenizer: Any, kwargs: dict[str, Any]) -> str:
    """What opens a system turn ("" when the template refuses system turns: Gemma)."""
    try:
        text = _render(
            tokenizer,
            [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}],
            kwargs,
        )
    except Exception:  # noqa: BLE001 - a template without a system role has no marker for it
        return ""
    return text.split(SYSTEM, 1)[0].strip() if text.count(SYSTEM) == 1 else ""


def opening(tokenizer: Any, messages: list[dict], template_kwargs: dict[str, Any]) -> str:
    """The text that opens the next user turn after `messages` (empty: the first turn)."""
    text = _render(tokenizer, [*messages, {"role": "user", "content": USER}], template_kwargs)
    before, _ = _split(text, USER, "user's text", _where(tokenizer))
    return before


def answer_prompt(tokenizer: Any, messages: list[dict], template_kwargs: dict[str, Any]) -> str:
    """The prompt the verifier answers `messages` from, as generate renders it."""
    return chat_template.render_prompt(
        tokenizer, {"id": "synthesized", "messages": messages}, template_kwargs
    )


def cut(text: str, stops: Sequence[str]) -> tuple[str, bool]:
    """`text` up to the first stop string, and whether one was there."""
    found = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return (text[: min(found)], True) if found else (text, False)


def decode_turn(
    tokenizer: Any, ids: Sequence[int], stop_ids: Sequence[int], stops: Sequence[str], ended: bool
) -> tuple[str, bool]:
    """(the turn's text, whether it ended) from the ids a sampler emitted: cut at the first stop
    id, decoded with special tokens kept (the leak filter must see them), cut at the first stop
    string. `ended`: the sampler saw the turn end (a stop, or the model's end of sequence)."""
    end = next((i for i, t in enumerate(ids) if t in stop_ids), None)
    text = tokenizer.decode(list(ids if end is None else ids[:end]), skip_special_tokens=False)
    text, found = cut(text, stops)
    return text, ended or found or end is not None


def answer_content(prompt: str, text: str) -> str:
    """An answer's content, without the reasoning (as generate's parser keeps it apart): after
    `</think>` when the answer reasoned; "" when its reasoning never ended."""
    opened = prompt.rstrip().endswith(chat_template.THINK_START)
    if opened or chat_template.THINK_START in text or chat_template.THINK_END in text:
        return split_reasoning(text)[1].strip()
    return text.strip()
