"""Issue 13's proof: a drafter published the SpecForge way starts a run where it left off.

published_drafter.py trains one on a tiny verifier's features (SGLang ids [1, 3, 4] = ours
[2, 4, 5], no norm before fc), saves it flat, and builds the drafter speculators' trainer starts
from, with the conventions carried and with the old behaviour (ids as written, default norms).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from published_drafter import proof


@pytest.mark.slow
def test_init_with_carried_conventions_equals_the_published_drafter(tmp_path: Path) -> None:
    n = proof(tmp_path)
    # The published drafter learned something, so equal acceptance means something.
    assert n["published"] > 1.5, n
    # Zero steps: the same offline acceptance on the same features, within 1% (bf16 save).
    assert abs(n["init_carried"] - n["published"]) <= 0.01 * n["published"], n
    # Fine-tuning starts no worse than the checkpoint had it (bf16 rounding: 1%).
    assert n["loss_init_carried"] <= 1.01 * n["loss_published"], n
    # The old behaviour (ids one layer early, speculators' default norms) starts elsewhere:
    # measured 0.68 vs 0.47. Its acceptance drop is small on this verifier (adjacent layers of
    # a random 8-layer model carry nearly the same features) and is reported, not asserted.
    assert n["loss_init_old"] > 1.2 * n["loss_init_carried"], n
