"""The P-EAGLE/DFlash mask token: resolved once, never a token the verifier emits."""

from __future__ import annotations

from typing import Any

import pytest
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import PreTrainedTokenizerFast

from eagle3_pipeline.core.errors import ParamsError
from eagle3_pipeline.drafter.mask_token import resolve_mask_token

WORDS = ["<eos>", "<think>", "<reserved_0>", "hello", "world"]


def _tokenizer(mask: bool = False) -> Any:
    vocab = {w: i for i, w in enumerate(WORDS + (["<mask>"] if mask else []))}
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="<eos>")), eos_token="<eos>"
    )
    tok.add_special_tokens(
        {"additional_special_tokens": ["<think>", "<reserved_0>"]}
        | ({"mask_token": "<mask>"} if mask else {})
    )
    return tok


def test_resolution_order() -> None:
    rows = [[3, 4, 0]]
    assert resolve_mask_token(_tokenizer(mask=True), 8, None, rows)[0] == 5  # its mask token
    assert resolve_mask_token(_tokenizer(), 8, None, rows) == (
        5,
        "the first embedding row no tokenizer id uses",
    )
    assert resolve_mask_token(_tokenizer(), 8, 2, rows)[0] == 2  # a reserved special token
    assert resolve_mask_token(_tokenizer(), 8, 7, rows)[0] == 7  # a row no text maps to


@pytest.mark.parametrize(
    ("vocab", "explicit", "rows", "message"),
    [
        (8, 0, [[3]], "is the tokenizer's eos_token_id"),
        (8, 3, [[4]], "is the ordinary token 'hello'"),
        (8, 8, [[3]], "past the verifier's 8 embedding rows"),
        (8, 1, [[3], [4, 1]], r"occurs in the training data \(row 1"),
        (5, None, [[3]], "every one of its 5 embedding rows is a token"),
    ],
)
def test_refusals_name_the_field(
    vocab: int, explicit: int | None, rows: list, message: str
) -> None:
    with pytest.raises(ParamsError, match=message) as err:
        resolve_mask_token(_tokenizer(), vocab, explicit, rows)
    assert "train.family.mask_token_id" in str(err.value)


def test_a_branch_is_named_by_its_own_key() -> None:
    with pytest.raises(ParamsError, match=r"field 'families\.dflash\.mask_token_id': 0 is"):
        resolve_mask_token(_tokenizer(), 8, 0, [[3]], field="families.dflash.mask_token_id")
