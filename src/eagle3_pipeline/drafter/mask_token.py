"""The mask token P-EAGLE and DFlash feed in the positions they draft: one the verifier never emits.

speculators' own fallback, when no id is given and the tokenizer has no mask token and no free
row, is the pad, eos or unk token: eos is a token the verifier emits, so the drafter would learn
a mask that also means "end". Here the id is resolved once, before any weights load, and checked
against the tokenizer (an ordinary token or one the chat template writes is refused) and against
every row the drafter trains on (an id that occurs there is refused).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from eagle3_pipeline.config.families import FamilyParams
from eagle3_pipeline.core.errors import ParamsError
from eagle3_pipeline.verifier.identity import VerifierFacts


def resolve_mask_token(
    tokenizer: Any,
    vocab_size: int,
    explicit: int | None,
    rows: Iterable[list[int]],
    *,
    where: str = "params.yaml",
    field: str = "train.family.mask_token_id",
) -> tuple[int, str]:
    """(mask id, how it was chosen); ParamsError naming the field when it is unusable.

    Order: the explicit id; the tokenizer's mask token; the first embedding row (< vocab_size)
    that no tokenizer id uses (ids past len(tokenizer) are rows no text maps to).
    """
    if explicit is not None:
        chosen, how = explicit, field
    elif getattr(tokenizer, "mask_token_id", None) is not None:
        chosen, how = int(tokenizer.mask_token_id), f"the tokenizer's {tokenizer.mask_token!r}"
    elif len(tokenizer) < vocab_size:
        chosen, how = len(tokenizer), "the first embedding row no tokenizer id uses"
    else:
        raise ParamsError(
            f"{where}: field '{field}': the verifier's tokenizer has no mask token and every "
            f"one of its {vocab_size} embedding rows is a token: set {field} to a reserved "
            "special token's id"
        )
    at = f"{where}: field '{field}'"
    _check_tokenizer(tokenizer, vocab_size, chosen, at)
    _check_rows(chosen, rows, at)
    return chosen, how


def _check_tokenizer(tokenizer: Any, vocab_size: int, token_id: int, at: str) -> None:
    if token_id >= vocab_size:
        raise ParamsError(
            f"{at}: {token_id} is past the verifier's {vocab_size} embedding "
            f"rows: choose an id below {vocab_size}"
        )
    emitted = {
        getattr(tokenizer, name, None): name
        for name in ("eos_token_id", "bos_token_id", "pad_token_id", "unk_token_id")
    }
    if token_id in emitted:
        raise ParamsError(
            f"{at}: {token_id} is the tokenizer's {emitted[token_id]}, a "
            "token in the verifier's text: choose a reserved special token or an unused row"
        )
    if token_id >= len(tokenizer):
        return  # a row no text maps to
    special = set(getattr(tokenizer, "all_special_ids", []))
    added = {i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if t.special}
    if token_id not in special | added:
        text = tokenizer.convert_ids_to_tokens(token_id)
        raise ParamsError(
            f"{at}: {token_id} is the ordinary token {text!r}, which the "
            "verifier can emit: choose a reserved special token or an id >= "
            f"{len(tokenizer)} (rows no text maps to)"
        )


def _check_rows(token_id: int, rows: Iterable[list[int]], at: str) -> None:
    for n, ids in enumerate(rows):
        if token_id in ids:
            raise ParamsError(
                f"{at}: {token_id} occurs in the training data (row {n} of "
                "data/tokenized): the verifier emits it, so it cannot mark drafted positions; "
                "choose another id"
            )


def for_run(
    family: FamilyParams,
    verifier: VerifierFacts,
    rows: list[list[int]],
    family_key: str = "train.family",
) -> tuple[int, str] | None:
    """The run's (mask id, how chosen) when its family drafts with one (`family_key`: where
    params.yaml holds the family, for the error lines)."""
    if not family.uses_mask_token:
        return None
    from eagle3_pipeline.verifier.loading import load_tokenizer

    field = f"{family_key}.mask_token_id"
    return resolve_mask_token(
        load_tokenizer(verifier), verifier.vocab_size, family.mask_token_id, rows, field=field
    )
