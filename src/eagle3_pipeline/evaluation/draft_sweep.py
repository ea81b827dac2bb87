"""One drafter at several draft counts (evaluate.num_speculative_tokens_sweep): each family at its
best, not only at the common count.

More drafts accept more tokens per verification but cost more to draft (a chained drafter one
pass per draft) and to verify, so the best count is the one with the highest speed-up, which
only vLLM's own runs show. Each count's server is timed against the baseline's in paired rounds
as the common count's is (evaluation/speedup.py): the counts' servers run at different moments,
so their tokens/s do not compare with each other, but each one's ratio to the baseline beside it
does. A count whose rounds spread too wide has no speed-up and cannot be the best. Each count's
row sits beside the simulation's walk at that count (the like-for-like check of acceptance, as
at the common count).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from eagle3_pipeline.evaluation.acceptance import served_acceptance

if TYPE_CHECKING:
    from eagle3_pipeline.config.params import EvaluateParams
    from eagle3_pipeline.evaluation.measure import RunResult
    from eagle3_pipeline.evaluation.offline import Simulation


def row(baseline: RunResult, run: RunResult, timing: Mapping[str, Any], k: int) -> dict[str, Any]:
    """vLLM's acceptance (the full pass) and the speed-up (`timing`: the paired rounds' keys,
    speedup.judge) of the drafter served at `k` drafts."""
    served = served_acceptance(run.counters, k)
    same_outputs = (run.token_ids, run.texts) == (baseline.token_ids, baseline.texts)
    return {
        "mean_acceptance_length": served["mean_acceptance_length"],
        "acceptance_rate": served["acceptance_rate"],
        **timing,
        "greedy_outputs_identical": same_outputs,
    }


def section(
    baseline: RunResult, runs: Mapping[int, tuple[RunResult, Mapping[str, Any]]]
) -> dict[str, Any]:
    """eval.json `online` keys for the drafter served at each count of `runs` (its full pass and
    paired rounds' keys; empty for one count). The best count: the highest speed-up among those
    that have one; None when none has."""
    if len(runs) < 2:
        return {}
    by = {str(k): row(baseline, run, timing, k) for k, (run, timing) in sorted(runs.items())}
    figures = {k: r["speedup"] for k, r in by.items() if r.get("speedup") is not None}
    best = max(figures, key=lambda k: figures[k]) if figures else None
    return {
        "by_num_speculative_tokens": by,
        "best_num_speculative_tokens": int(best) if best is not None else None,
    }


def same_prompts(sim: Simulation, e: EvaluateParams) -> dict[str, Any]:
    """eval.json `offline_same_prompts`: the served drafter's walk through the online run's
    prompts; with a sweep, the walk's mean acceptance length at each further count too."""
    assert sim.same is not None
    out = sim.same.summary() | {"num_prompts": sim.num_same, "max_new_tokens": e.max_new_tokens}
    if sim.same_by_k:
        out["by_num_speculative_tokens"] = {
            str(k): c.summary()["mean_acceptance_length"] for k, c in sorted(sim.same_by_k.items())
        }
    return out


def with_simulated(online: dict[str, Any], same: dict[str, Any] | None, k: int) -> dict[str, Any]:
    """`online` with the simulated walk's mean acceptance length (`offline_same_prompts`) in each
    count's row (`k`: the count `same` was walked at): the like-for-like check of acceptance at
    every count served."""
    rows = online.get("by_num_speculative_tokens")
    if not rows or not same:
        return online
    walks = {str(k): same["mean_acceptance_length"], **same.get("by_num_speculative_tokens", {})}
    key = "offline_same_prompts_mean_acceptance_length"
    rows = {n: r | ({key: walks[n]} if n in walks else {}) for n, r in rows.items()}
    return online | {"by_num_speculative_tokens": rows}
