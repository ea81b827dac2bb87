"""What evaluate concludes from vLLM's figures: served acceptance against the simulated one (the
MISMATCH alarm, with the causes it names), and whether speculative decoding stayed lossless.
One rule for `evaluate` and every `family@NAME` branch, so their verdicts are one measure."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eagle3_pipeline.config.params import EvaluateParams
from eagle3_pipeline.core import paths
from eagle3_pipeline.core.errors import ServerError
from eagle3_pipeline.core.progress import log
from eagle3_pipeline.evaluation import draft_sweep, speedup
from eagle3_pipeline.evaluation.losslessness import Verdict

STAGE = "evaluate"
MISMATCH_CAUSES = (
    "aux/final layer ids, vocab mapping d2t/t2d, norm_before_fc/norm_output flags, or a "
    "different verifier"
)


def is_mismatch(online_mal: float, offline_mal: float, ratio: float) -> bool:
    """Coarse rule (no like-for-like figure): served gain far below the simulated gain."""
    return online_mal - 1 < ratio * (offline_mal - 1)


def relative_gap(online_mal: float, offline_mal: float) -> float | None:
    """(online - offline) / offline in accepted tokens per draft (mean acceptance length - 1);
    None when the simulation accepts nothing."""
    gain = offline_mal - 1
    return (online_mal - 1 - gain) / gain if gain > 0 else None


def is_short(online_mal: float, offline_mal: float, tolerance: float) -> bool:
    """Tight rule, on the same prompts and positions: vLLM accepts more than `tolerance` fewer
    tokens per draft than simulated. Only shortfalls: every cause it names lowers acceptance."""
    gap = relative_gap(online_mal, offline_mal)
    return gap is not None and gap < -tolerance


def online_verdict(
    section: dict[str, Any],
    offline_mal: float,
    mismatched: list[str],
    e: EvaluateParams,
    verdict: Verdict | None = None,
    offline_same: dict[str, Any] | None = None,
    drafter_dir: Path = paths.DRAFTER,
) -> dict[str, Any]:
    """eval.json keys of the online run; logs summary lines and, if needed, one warning.

    With `offline_same` (the simulation on the online run's prompts and positions, with
    drafts) the alarm is evaluate.mismatch_tolerance against it; else mismatch_ratio against
    `offline_mal`. `e`: params' `evaluate` section.
    """
    mal = section["mean_acceptance_length"]
    if offline_same is not None and offline_same.get("num_drafts"):
        reference = offline_same["mean_acceptance_length"]
        gap = relative_gap(mal, reference)
        mismatch = is_short(mal, reference, e.mismatch_tolerance)
        rule = {
            "compared_with": "offline_same_prompts",
            "offline_mean_acceptance_length": reference,
            "relative_gap": gap,
            "mismatch_tolerance": e.mismatch_tolerance,
        }
        limit = f"more than evaluate.mismatch_tolerance={e.mismatch_tolerance} short of it"
        what = "simulated on the same prompts and positions"
    else:
        reference = offline_mal
        mismatch = is_mismatch(mal, offline_mal, e.mismatch_ratio)
        rule = {
            "compared_with": "offline",
            "offline_mean_acceptance_length": reference,
            "relative_gap": relative_gap(mal, reference),
            "mismatch_ratio": e.mismatch_ratio,
        }
        limit = f"below evaluate.mismatch_ratio={e.mismatch_ratio} of its gain"
        what = "simulated"
    log(
        STAGE,
        f"vLLM: mean acceptance length {mal:.3f} ({what} {reference:.3f}), acceptance rate "
        f"{section['acceptance_rate']:.1%} on {section['num_prompts']} val prompts; "
        f"{speedup.throughput(section)}",
    )
    for c, row in section.get("by_concurrency", {}).items():
        log(
            STAGE,
            f"vLLM at concurrency {c}: mean acceptance length "
            f"{row['mean_acceptance_length']:.3f}; {speedup.throughput(row)}",
        )
    section = draft_sweep.with_simulated(section, offline_same, e.num_speculative_tokens)
    for n, row in section.get("by_num_speculative_tokens", {}).items():
        walked = row.get("offline_same_prompts_mean_acceptance_length")
        log(
            STAGE,
            f"vLLM at {n} drafts: mean acceptance length {row['mean_acceptance_length']:.3f}"
            + (f" (simulated {walked:.3f})" if walked is not None else "")
            + f", {speedup.cell(row)}"
            + (" <- best" if int(n) == section["best_num_speculative_tokens"] else ""),
        )
    if mismatch:
        log(
            STAGE,
            f"MISMATCH: vLLM accepts far less than simulated ({mal:.2f} vs {reference:.2f}, "
            f"{limit}); likely causes: "
            f"{MISMATCH_CAUSES}: compare {drafter_dir}/config.json with the served verifier",
        )
    section = section | {"greedy_mismatched_ids": mismatched[:20]}
    out = {
        "online": section,
        "greedy_outputs_identical": not mismatched,
        "mismatch": mismatch,
        "mismatch_rule": rule,
    }
    if verdict is not None:
        out["lossless"] = verdict.section()
        near = verdict.near_ties
        log(
            STAGE,
            f"losslessness: {verdict.outcome} (identical on "
            f"{out['lossless']['num_identical']}, near ties on {len(near)}, diverged on "
            f"{len(verdict.diverged)} of {verdict.num_prompts} prompts; top-"
            f"{verdict.top_logprobs} logprobs, near tie <= {verdict.near_tie_nats} nats)"
            + (f"; first near tie: {near[0].describe()}" if near else ""),
        )
    return out


def require_lossless(verdict: Verdict, logs: Path) -> None:
    """The run's error when greedy outputs diverged where the baseline was sure; it names the
    folder of the servers' logs."""
    if verdict.passed:
        return
    first = verdict.diverged[0]
    raise ServerError(
        f"greedy outputs with the drafter diverge from those without it where the baseline "
        f"was sure, on {len(verdict.diverged)} of {verdict.num_prompts} prompts served (first: "
        f"{first.describe()}; only near ties up to evaluate.near_tie_nats="
        f"{verdict.near_tie_nats} pass): speculative decoding is not lossless here; logs "
        f"in {logs}"
    )
