"""eval.json's `served` block, its headline: vLLM's acceptance per prompt set (the val prompts,
then each public set) with its paired speed-ups, and the lowest set's figure."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eagle3_pipeline.config.params import EvaluateParams
from eagle3_pipeline.core.progress import log

STAGE = "evaluate"


def served_headline(
    online: dict[str, Any], held: dict[str, dict[str, Any]], e: EvaluateParams, val_prompts: Path
) -> dict[str, Any]:
    """eval.json's `served` block, its headline: per prompt set (the val prompts, then each
    public set) vLLM's acceptance with its detail (evaluation/served.py) and paired speed-ups,
    and the lowest set's figure, the one a drafter has to earn. `val_prompts`: the file the val
    prompts were read from."""
    timed = online.get("by_concurrency") or {str(e.concurrency): online}
    val = {
        "source": f"{val_prompts} (first {e.max_eval_prompts})",
        "num_prompts": online["num_prompts"],
        "max_new_tokens": e.max_new_tokens,
        **online.get("served", {}),
        "num_identical": online["num_prompts"] - len(online.get("greedy_mismatched_ids", [])),
        "speedup_by_concurrency": {
            c: {key: row.get(key) for key in SPEEDUP_KEYS} for c, row in timed.items()
        },
    }
    sets = {"val": val} | {
        name: got
        | {
            "speedup_by_concurrency": {
                c: {key: row.get(key) for key in SPEEDUP_KEYS}
                for c, row in got["speedup_by_concurrency"].items()
            }
        }
        for name, got in held.items()
    }
    lowest = min(sets, key=lambda n: sets[n]["mean_acceptance_length"])
    for name, got in sets.items():
        if name != "val":
            log(STAGE, f"served on {name}: {_served_line(got)}")
    log(STAGE, f"served on val: {_served_line(val)}")
    return {
        "num_speculative_tokens": e.num_speculative_tokens,
        "lowest_set": lowest,
        "lowest_mean_acceptance_length": sets[lowest]["mean_acceptance_length"],
        "sets": sets,
    }


SPEEDUP_KEYS = (
    "speedup",
    "speedup_spread",
    "speedup_trusted",
    "speedup_rounds",
    "speedup_num_prompts",
    "tokens_per_s",
    "tokens_per_s_baseline",
)


def _served_line(got: dict[str, Any]) -> str:
    speedups = ", ".join(
        f"x{row['speedup']:.2f} at concurrency {c}" if row.get("speedup") else f"no figure at {c}"
        for c, row in got["speedup_by_concurrency"].items()
    )
    per_pos = [round(a, 3) for a in got.get("acceptance_per_position", [])]
    return (
        f"mean acceptance length {got['mean_acceptance_length']:.3f} over {got['num_prompts']} "
        f"prompts (per draft position {per_pos}), identical {got['num_identical']} of "
        f"{got.get('num_answers', got['num_prompts'])} answers; {speedups}"
    )
