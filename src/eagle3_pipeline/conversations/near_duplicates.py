"""Exact and near duplicates among synthesized prompts, each checked against those kept before.

Exact: the same normalized text (Unicode NFKC, case-folded, words only, so spacing and
punctuation do not count). Near: the Jaccard similarity of the two texts' word shingles is at
least the threshold. Shingles are single words (SHINGLE_WORDS): prompts are short, and one
changed word changes k shingles of k words, so a 12-word prompt with one word changed is at
Jaccard 0.85 with k=1 but 0.69 with k=2 and 0.56 with k=3; only k=1 keeps the threshold's
plain meaning ("share that share of their words") at prompt length.

Candidates come from MinHash signatures (NUM_PERM multiply-shift hashes `(a*x + b) mod 2**64 >>
32` of each shingle's 64-bit blake2b hash x, a odd; the minimum of each over the text's
shingles; `(a*x + b) mod p` with small a and x would order shingles almost as x does, and
agree far less often than the Jaccard similarity says) cut into LSH bands: two texts are
compared when one band is equal. The band shape is the narrowest that makes a pair AT the
threshold a candidate with probability >= RECALL; every candidate is then verified by the exact
Jaccard of the shingle sets, so the LSH only decides which pairs are compared, never what
counts as a near duplicate. numpy only (no MinHash library is in the lock).
"""

from __future__ import annotations

import hashlib
import re
import unicodedata
from collections import defaultdict

import numpy as np

SHINGLE_WORDS = 1
NUM_PERM = 128
RECALL = 0.999  # chance that a pair exactly at the threshold is compared at all
_SHIFT = np.uint64(32)
_WORD = re.compile(r"\w+")


def words(text: str) -> list[str]:
    return _WORD.findall(unicodedata.normalize("NFKC", text).casefold())


def normalize(text: str) -> str:
    """What an exact duplicate shares: the words, case-folded, one space apart."""
    return " ".join(words(text))


def shingles(text: str, k: int = SHINGLE_WORDS) -> frozenset[str]:
    w = words(text)
    if len(w) <= k:
        return frozenset([" ".join(w)]) if w else frozenset()
    return frozenset(" ".join(w[i : i + k]) for i in range(len(w) - k + 1))


def jaccard(a: frozenset[str], b: frozenset[str]) -> float:
    return len(a & b) / len(a | b) if a or b else 1.0


def band_shape(threshold: float, num_perm: int = NUM_PERM) -> tuple[int, int]:
    """(bands, rows per band): the most rows (fewest false candidates) whose chance of making a
    pair at `threshold` a candidate, 1 - (1 - t**rows)**bands, is still >= RECALL."""
    for rows in range(num_perm, 0, -1):
        bands = num_perm // rows
        if 1 - (1 - threshold**rows) ** bands >= RECALL:
            return bands, rows
    return num_perm, 1


class NearDuplicates:
    """The prompts kept so far; `offer` says whether a new one is a duplicate of one of them."""

    def __init__(self, threshold: float, num_perm: int = NUM_PERM, seed: int = 0) -> None:
        if not 0.0 < threshold <= 1.0:
            raise ValueError(f"threshold must be in (0, 1], got {threshold}")
        self.threshold = threshold
        rng = np.random.default_rng(seed)
        one = np.uint64(1)
        self._a = (rng.integers(0, 1 << 63, num_perm, dtype=np.uint64) << one | one)[:, None]
        self._b = (rng.integers(0, 1 << 63, num_perm, dtype=np.uint64) << one)[:, None]
        self.bands, self.rows = band_shape(threshold, num_perm)
        self._exact: set[str] = set()
        self._sets: list[frozenset[str]] = []
        self._buckets: list[dict[bytes, list[int]]] = [defaultdict(list) for _ in range(self.bands)]

    def __len__(self) -> int:
        return len(self._exact)

    def signature(self, shingle_set: frozenset[str]) -> np.ndarray:
        x = np.array(
            [
                int.from_bytes(hashlib.blake2b(s.encode(), digest_size=8).digest(), "little")
                for s in sorted(shingle_set)
            ],
            dtype=np.uint64,
        )[None, :]
        return ((self._a * x + self._b) >> _SHIFT).min(axis=1)  # uint64 arithmetic wraps

    def _keys(self, sig: np.ndarray) -> list[bytes]:
        r = self.rows
        return [sig[i * r : (i + 1) * r].tobytes() for i in range(self.bands)]

    def offer(self, text: str) -> str | None:
        """None: `text` is kept (and remembered); else why not: "duplicate" (the same normalized
        text as a kept one) or "near_duplicate" (word Jaccard >= threshold with a kept one)."""
        norm = normalize(text)
        if norm in self._exact:
            return "duplicate"
        s = shingles(text)
        keys: list[bytes] = []
        if s:
            keys = self._keys(self.signature(s))
            seen: set[int] = set()
            for band, key in zip(self._buckets, keys, strict=True):
                for j in band.get(key, ()):
                    if j not in seen:
                        seen.add(j)
                        if jaccard(s, self._sets[j]) >= self.threshold:
                            return "near_duplicate"
        self._exact.add(norm)
        if s:
            index = len(self._sets)
            self._sets.append(s)
            for band, key in zip(self._buckets, keys, strict=True):
                band[key].append(index)
        return None
