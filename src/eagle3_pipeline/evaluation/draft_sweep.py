"""One drafter at several draft counts (evaluate.num_speculative_tokens_sweep): each family at its
best, not only at the common count.

More drafts accept more tokens per verification but cost more to draft (a chained drafter one
pass per draft) and to verify, so the best count is the one with the most output tokens/s, which
only vLLM's own runs show. Each count's row sits beside the simulation's walk at that count (the
like-for-like check of acceptance, as at the common count).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from eagle3_pipeline.evaluation import acceptance

if TYPE_CHECKING:
    from eagle3_pipeline.evaluation.offline import Simulation
    from eagle3_pipeline.evaluation.online import RunResult
    from eagle3_pipeline.params import EvaluateParams


def row(baseline: RunResult, run: RunResult, k: int) -> dict[str, Any]:
    """vLLM's acceptance and throughput of the drafter served at `k` drafts."""
    same_outputs = (run.token_ids, run.texts) == (baseline.token_ids, baseline.texts)
    return acceptance.served_row(
        run.output_tokens, run.wall_s, baseline.output_tokens, baseline.wall_s, run.counters, k
    ) | {"greedy_outputs_identical": same_outputs}


def section(baseline: RunResult, runs: Mapping[int, RunResult]) -> dict[str, Any]:
    """eval.json `online` keys for the drafter served at each count of `runs` (empty for one)."""
    if len(runs) < 2:
        return {}
    by = {str(k): row(baseline, run, k) for k, run in sorted(runs.items())}
    best = max(by, key=lambda k: by[k]["tokens_per_s"])
    return {"by_num_speculative_tokens": by, "best_num_speculative_tokens": int(best)}


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
