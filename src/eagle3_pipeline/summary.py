"""Print what `make train` produced: where the drafter is and its measured acceptance."""

from __future__ import annotations

import json
import sys

from eagle3_pipeline import paths

DRAFTER = paths.DRAFTER
EVAL = paths.EVAL_METRICS


def main() -> int:
    if not EVAL.is_file():
        print(
            f"error: {EVAL} not found: the evaluate stage has not run (dvc repro)", file=sys.stderr
        )
        return 2
    ev = json.loads(EVAL.read_text())
    tr, un = ev["offline"]["trained"], ev["offline"]["untrained"]
    print(
        f"drafter: {DRAFTER.resolve()} (speculators format; serve with vLLM "
        f'--speculative-config \'{{"method": "eagle3", "model": "{DRAFTER}", '
        f'"num_speculative_tokens": {ev["num_speculative_tokens"]}}}\')'
    )
    print(
        f"offline simulated mean acceptance length: {tr['mean_acceptance_length']:.3f} of "
        f"{1 + ev['num_speculative_tokens']} (untrained drafter: "
        f"{un['mean_acceptance_length']:.3f}); acceptance rate {tr['acceptance_rate']:.1%}; "
        f"per position {[round(a, 3) for a in tr['acceptance_per_position']]}"
    )
    online = ev.get("online")
    if online:
        print(
            f"online (vLLM): mean acceptance length {online['mean_acceptance_length']:.3f}, "
            f"acceptance rate {online['acceptance_rate']:.1%}, "
            f"{online['tokens_per_s']:.1f} tokens/s with the drafter vs "
            f"{online['tokens_per_s_baseline']:.1f} without (x{online['speedup']:.2f}); "
            f"greedy outputs identical: {ev.get('greedy_outputs_identical')}"
        )
        if ev.get("mismatch"):
            print("MISMATCH: online acceptance is far below the offline simulation (see evaluate)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
