"""Print what `make train` produced: where the drafter is and its measured acceptance, and,
with `families` branches, every drafter of the run in one table.

The numbers are this run's only if metrics/eval.json was measured under the current params: its
provenance record says which params it was; a mismatch is said first and plainly, exit 1. The
speed-up is printed with the paired rounds it is the median of, or, when they spread too wide to
trust, as no figure with the reason (evaluation/speedup.py).
"""

from __future__ import annotations

import json
import sys

from eagle3_pipeline.config.params import load_params
from eagle3_pipeline.core import paths
from eagle3_pipeline.core.errors import PipelineError
from eagle3_pipeline.evaluation import learning_curve, speedup
from eagle3_pipeline.harness import provenance
from eagle3_pipeline.report import comparison

DRAFTER = paths.DRAFTER
EVAL = paths.EVAL_METRICS
EVAL_RECORD = paths.PROVENANCE / "evaluate.json"


def provenance_problem(params_file: str = "params.yaml") -> str | None:
    """Why metrics/eval.json may not belong to the current params; None when it does."""
    if not EVAL_RECORD.is_file():
        return f"{EVAL_RECORD} not found: nothing says which params {EVAL} was measured with"
    record = json.loads(EVAL_RECORD.read_text())
    params = load_params(params_file)
    now = provenance.params_sha256(params)
    if record.get("params_sha256") != now:
        return (
            f"{EVAL} was measured with other params than {params_file} holds now (recorded "
            f"{record.get('recorded_at')} at commit {str(record.get('git_commit'))[:12]}, "
            f"profile {record.get('profile')}; current profile {params.profile})"
            ": these are NOT the numbers of the current params; run `dvc repro` (make train)"
        )
    return None


def main() -> int:
    if not EVAL.is_file():
        print(
            f"error: {EVAL} not found: the evaluate stage has not run (dvc repro)", file=sys.stderr
        )
        return 2
    try:
        problem = provenance_problem()
    except PipelineError as exc:
        problem = str(exc)
    if problem:
        print(f"WARNING: {problem}", file=sys.stderr)
    ev = json.loads(EVAL.read_text())
    tr, un = ev["offline"]["trained"], ev["offline"]["untrained"]
    print(
        f"drafter: {DRAFTER.resolve()} (speculators format; serve with vLLM "
        f'--speculative-config \'{{"method": "eagle3", "model": "{DRAFTER}", '
        f'"num_speculative_tokens": {ev["num_speculative_tokens"]}}}\')'
    )
    if served := ev.get("served"):
        rows = []
        for name, got in served["sets"].items():
            times = [
                f"x{row['speedup']:.2f}@{c}"
                for c, row in got["speedup_by_concurrency"].items()
                if row.get("speedup")
            ]
            rows.append(
                f"{name} {got['mean_acceptance_length']:.3f}"
                + (f" ({', '.join(times)})" if times else "")
            )
        print(
            f"served (vLLM's counts, {served['num_speculative_tokens']} drafts) on held-out "
            f"prompts: {'; '.join(rows)}; lowest: {served['lowest_set']} "
            f"{served['lowest_mean_acceptance_length']:.3f}"
        )
    init = ev["offline"].get("init")
    init_text = (
        f", init checkpoint without fine-tuning: {init['mean_acceptance_length']:.3f}"
        if init
        else ""
    )
    print(
        f"offline simulated mean acceptance length: {tr['mean_acceptance_length']:.3f} of "
        f"{1 + ev['num_speculative_tokens']} (untrained drafter: "
        f"{un['mean_acceptance_length']:.3f}{init_text}); acceptance rate "
        f"{tr['acceptance_rate']:.1%}; per position "
        f"{[round(a, 3) for a in tr['acceptance_per_position']]}"
    )
    online = ev.get("online")
    if online:
        print(
            f"online (vLLM): mean acceptance length {online['mean_acceptance_length']:.3f}, "
            f"acceptance rate {online['acceptance_rate']:.1%}, {speedup.throughput(online)}; "
            f"greedy outputs identical: {ev.get('greedy_outputs_identical')}"
        )
        if ev.get("mismatch"):
            print("MISMATCH: online acceptance is far below the offline simulation (see evaluate)")
    _print_curve()
    compared = _print_comparison(ev["num_speculative_tokens"])
    return 1 if problem or not compared else 0


def _print_curve() -> None:
    """The learning curve (curve stage), where this run made one: what more data would buy."""
    if not paths.CURVE.is_file():
        return
    curve = json.loads(paths.CURVE.read_text())
    lines = learning_curve.summary_lines(curve)
    if lines:
        print(f"learning curve ({paths.CURVE}; eagle3 plan turns it into data, disk and hours):")
        for line in lines:
            print(f"  {line}")


def _print_comparison(k: int) -> bool:
    """With `families` branches: every drafter of the run in one table (report.comparison);
    False when a metrics file of theirs could not be read."""
    try:
        params = load_params()
    except PipelineError:
        return True  # said above, by provenance_problem
    if params.families:
        print(
            f"\ndrafters at {k} draft tokens (offline: simulated on the val samples; vLLM: served "
            "on the val prompts; best: the draft count with the most tokens/s):"
        )
        try:
            print(comparison.table(comparison.rows(params.train.family, params.families)))
        except PipelineError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return False
    return True


if __name__ == "__main__":
    sys.exit(main())
