"""How many synthesized and given prompts a mix takes (prepare.synthesized_share): shared by
prepare, which takes them, and the plan, which counts them before any prompt exists."""

from __future__ import annotations

import math


def mix_counts(synthesized: int, given: int, share: float) -> tuple[int, int]:
    """(synthesized, given) rows to take: the largest mix with `share` of it synthesized that
    `synthesized` and `given` usable rows allow (1.0: every synthesized row, no given one)."""
    if share >= 1.0:
        return synthesized, 0
    total = math.floor(min(synthesized / share, given / (1.0 - share)) + 1e-9)
    syn = min(synthesized, round(total * share))
    return syn, min(given, total - syn)
