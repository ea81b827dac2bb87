"""Exact and near duplicates: normalized text, word-shingle Jaccard found through MinHash + LSH
and verified exactly; each prompt against those kept before it."""

from __future__ import annotations

import random

import pytest

from eagle3_pipeline.conversations.near_duplicates import (
    RECALL,
    NearDuplicates,
    band_shape,
    jaccard,
    normalize,
    shingles,
)

BASE = (
    "Can you explain how the water cycle works, from evaporation over the oceans to the rain "
    "that falls on the mountains?"
)
UNRELATED = [
    "Write a short poem about a lighthouse keeper who never sleeps.",
    "What are the main differences between TCP and UDP?",
    "How do I make a sourdough starter at home?",
    "Summarize the causes of the French Revolution in three sentences.",
    "Give me five names for a friendly robot in a children's book.",
    "Why does ice float on water?",
    "Translate 'good morning' into Spanish, French and German.",
    "What is a good stretching routine before running?",
    "Explain recursion to a ten-year-old.",
    "List three ways to reduce food waste in a restaurant kitchen.",
]


def test_exact_duplicates_by_normalized_text() -> None:
    d = NearDuplicates(0.8)
    assert d.offer("What is the capital of France?") is None
    assert d.offer("  what IS the capital of   france ") == "duplicate"
    assert normalize("Hello,  World!") == "hello world"


def test_a_paraphrase_with_one_word_changed_is_caught() -> None:
    d = NearDuplicates(0.8)
    assert d.offer(BASE) is None
    changed = BASE.replace("mountains", "hills")
    assert jaccard(shingles(BASE), shingles(changed)) >= 0.8
    assert d.offer(changed) == "near_duplicate"


def test_unrelated_prompts_are_kept() -> None:
    d = NearDuplicates(0.8)
    assert [d.offer(t) for t in [BASE, *UNRELATED]] == [None] * (len(UNRELATED) + 1)
    assert len(d) == len(UNRELATED) + 1


def test_each_prompt_is_checked_against_those_kept_before_it() -> None:
    """A prompt dropped as a near duplicate is no reference for later ones."""
    a = "one two three four five six seven eight nine ten"
    b = "one two three four five six seven eight nine eleven"  # J(a, b) = 9/11
    c = "one two three four five six seven eight twelve eleven"  # J(a, c) = 8/12, J(b, c) = 9/11
    d = NearDuplicates(0.8)
    assert [d.offer(a), d.offer(b), d.offer(c)] == [None, "near_duplicate", None]


@pytest.mark.parametrize("threshold", [0.5, 0.7, 0.8, 0.9, 1.0])
def test_band_shape_compares_pairs_at_the_threshold(threshold: float) -> None:
    bands, rows = band_shape(threshold)
    assert bands * rows <= 128
    assert 1 - (1 - threshold**rows) ** bands >= RECALL
    if rows < 128:  # one more row per band would miss more of them
        wider = 128 // (rows + 1)
        assert 1 - (1 - threshold ** (rows + 1)) ** wider < RECALL


def test_same_decisions_as_comparing_every_pair() -> None:
    """On 300 prompts, a third of them edits of others: LSH decides as brute force does."""
    rng = random.Random(0)
    vocab = [f"w{i}" for i in range(400)]
    texts: list[str] = []
    for _ in range(300):
        if texts and rng.random() < 0.35:
            words = rng.choice(texts).split()
            for _ in range(rng.randint(1, 4)):
                words[rng.randrange(len(words))] = rng.choice(vocab)
        else:
            words = rng.sample(vocab, rng.randint(12, 30))
        texts.append(" ".join(words))
    d = NearDuplicates(0.8)
    kept: list[frozenset[str]] = []
    seen: set[str] = set()
    for t in texts:
        s = shingles(t)
        if normalize(t) in seen:
            want = "duplicate"
        elif any(jaccard(s, k) >= 0.8 for k in kept):
            want = "near_duplicate"
        else:
            want = None
            kept.append(s)
            seen.add(normalize(t))
        assert d.offer(t) == want, t
    assert 150 < len(kept) < 280
