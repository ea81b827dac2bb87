"""Acceptance rate and mean acceptance length, as vLLM's own dashboards define them.

One formula for the simulated counts (offline.py) and vLLM's served counters (online.py), so
the two numbers eval.json compares can only differ in what was counted.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def summary(
    drafts: float, draft_tokens: float, accepted: float, accepted_per_pos: Sequence[float]
) -> dict[str, Any]:
    """rate = accepted / draft tokens; mean acceptance length = 1 + accepted / drafts."""
    return {
        "num_drafts": int(drafts),
        "num_draft_tokens": int(draft_tokens),
        "num_accepted_tokens": int(accepted),
        "acceptance_rate": accepted / draft_tokens if draft_tokens else 0.0,
        "mean_acceptance_length": 1 + accepted / drafts if drafts else 1.0,
        "acceptance_per_position": [a / drafts if drafts else 0.0 for a in accepted_per_pos],
    }


def served_acceptance(counts: dict[str, float], k: int) -> dict[str, Any]:
    """`summary` of vLLM's spec-decode counters (online.spec_counters, or their deltas)."""
    return summary(
        counts["num_drafts"],
        counts["num_draft_tokens"],
        counts["num_accepted_tokens"],
        [counts[f"accepted_pos_{p}"] for p in range(k)],
    )
