"""Stage `curve`: how much more data buys, before the GPU hours are spent.

`curve_train@F` trains train's drafter on the nested fraction F of the training rows (stages/
train.py, `--fraction`), then `eagle3 curve --measure F` simulates it offline, as evaluate
simulates train's drafter, on the same val samples, per sample (metrics/fractions/F/eval.json).
`eagle3 curve` measures train's drafter alike, fits mean acceptance length against training tokens
(evaluation/learning_curve.py: the line, and beside it the bend), checks each form fitted on the
smaller fractions against the largest point, predicts at `curve.predict_at` times the data with
intervals, and reads each point's val acceptance per epoch (the full run's and every fraction's,
and the epoch where it peaks). The result records the verifier it was measured on (its identity and
shape), so a plan for another verifier refuses to cost it. Outputs: metrics/curve.json and the plot
series metrics/curve/{tokens,epochs}.json. Without fractions it reports the full run's epochs only.
"""

from __future__ import annotations

import csv
import hashlib
import shutil
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3_pipeline.config.params import Params
from eagle3_pipeline.conversations import split
from eagle3_pipeline.core import atomic, paths, readers
from eagle3_pipeline.core.errors import DataError, StoreError
from eagle3_pipeline.core.progress import Progress, log
from eagle3_pipeline.drafter import load as drafter
from eagle3_pipeline.drafter.conventions import run_conventions
from eagle3_pipeline.evaluation import learning_curve as lc
from eagle3_pipeline.evaluation import offline
from eagle3_pipeline.store import format as store
from eagle3_pipeline.verifier import identity as vf

STAGE = "curve"


@dataclass
class Counts:
    """Per val sample: drafts simulated and draft tokens accepted (offline.accepted_prefix)."""

    drafts: list[int]
    accepted: list[int]


def measure(params: Params, fraction: float) -> None:
    """`eagle3 curve --measure F`: fraction F's best checkpoint on the val samples."""
    model_dir = paths.CURVE_MODELS / str(fraction) / "best"
    ids, counts = _simulate(params, vf.read_verifier(params.verifier), {"fraction": model_dir})
    rows = _train_rows(params, fraction)
    record = _record(params, fraction, rows, ids, counts["fraction"])
    out = paths.CURVE_FRACTIONS / str(fraction) / "eval.json"
    atomic.write_json(out, record)
    log(
        f"curve_train@{fraction}",
        f"{record['train_samples']} samples, {record['train_tokens']:,} tokens: mean "
        f"acceptance length {record['tau']:.3f} on {len(ids)} val samples -> {out}",
    )


def _prune_unlisted(fractions: list[float]) -> None:
    """Remove the results of fractions curve.fractions no longer lists: this stage reads
    metrics/fractions whole (a DVC dep, hashed after it runs), and a teammate's clone holds only
    the listed fractions' outputs, so leftovers would make the stage stale there."""
    if not paths.CURVE_FRACTIONS.is_dir():
        return
    keep = {str(f) for f in fractions}
    for d in sorted(paths.CURVE_FRACTIONS.iterdir()):
        if d.is_dir() and d.name not in keep:
            shutil.rmtree(d)
            log(STAGE, f"removed {d}: fraction {d.name} is no longer in curve.fractions")


def run(params: Params) -> None:
    c, k = params.curve, params.evaluate.num_speculative_tokens
    _prune_unlisted(c.fractions)
    facts = vf.read_verifier(params.verifier)  # first: refuses a missing one in one line
    verifier = fitted_on(facts)
    if not c.fractions:  # evaluate already simulated train's drafter: nothing to fit
        result = {"num_speculative_tokens": k, "verifier": verifier, "points": [], "check": None}
        _write(result | {"fit": None, "predictions": None, "epochs": _full_epochs()})
        return
    ids, counts = _simulate(params, facts, {"full": paths.DRAFTER})
    full = _record(params, 1.0, _train_rows(params, None), ids, counts["full"])
    records = [_read_fraction(f, full) for f in sorted(c.fractions)] + [full]
    points = [
        lc.Point(r["fraction"], r["train_samples"], r["train_tokens"], **r["per_sample"])
        for r in records
    ]
    result: dict[str, Any] = {
        "num_speculative_tokens": k,
        "verifier": verifier,
        "val_samples": len(ids),
        # Which val samples every point's per_sample counts are, in order (prepare's split).
        "val_ids_sha256": _ids_hash(ids),
        "form": "logit(alpha) = a + b ln(train_tokens); tau = 1 + alpha + ... + alpha^k",
        "confidence": c.confidence,
        "bootstrap_samples": c.bootstrap_samples,
    }
    targets = [full["train_tokens"] * m for m in c.predict_at]
    point_iv, predicted_iv = lc.bootstrap(
        points, k, targets, c.bootstrap_samples, c.confidence, seed=params.seed
    )
    result["points"] = [
        {
            "fraction": p.fraction,
            "train_samples": p.train_samples,
            "train_tokens": p.train_tokens,
            "tau": round(p.tau, 4),
            "tau_interval": _round(point_iv[i]),
            "epochs": _epochs(_val_tau_series(p.fraction)),
            # Each val sample's drafts and accepted tokens: another form can be fitted, and
            # bootstrapped like this one, from this file alone (the full run's counts are kept
            # nowhere else).
            "per_sample": records[i]["per_sample"],
        }
        for i, p in enumerate(points)
    ]
    result["check"] = _check(points, k, c, params.seed)
    result["fit"] = result["predictions"] = None
    if len(points) >= 2:
        f = lc.fit_points(points, k)
        result["fit"] = {"a": f.a, "b": f.b, "fitted_on": [p.fraction for p in points]}
        result["predictions"] = _predictions(f, c.predict_at, targets, predicted_iv)
    result["bend"] = _bend(points, k, c, targets, params.seed)
    result["epochs"] = _full_epochs()
    _write(result)


def _bend(
    points: list[lc.Point], k: int, c: Any, targets: list[float], seed: int
) -> dict[str, Any] | None:
    """The bend (logit quadratic in ln(tokens)) on every point, beside the line: its
    predictions with intervals (the same resamples as the line's) and its own check. None
    below three token counts."""
    tokens = [p.train_tokens for p in points]
    if len(set(tokens)) < lc.MIN_TOKEN_COUNTS["bend"]:
        return None
    b = lc.fit_bend(tokens, [p.tau for p in points], k)
    _, iv = lc.bootstrap(points, k, targets, c.bootstrap_samples, c.confidence, seed, "bend")
    return {
        "form": "logit(alpha) = c0 + c1 ln(train_tokens) + c2 ln(train_tokens)^2",
        "c": list(b.c),
        "bends": "up" if b.c[2] > 0 else "down",
        "fitted_on": [p.fraction for p in points],
        "check": _check(points, k, c, seed, "bend"),
        "predictions": _predictions(b, c.predict_at, targets, iv),
    }


def _predictions(
    fitted: lc.Fit | lc.Bend,
    multiples: list[float],
    targets: list[float],
    intervals: list[tuple[float, float]],
) -> list[dict[str, Any]]:
    """A form's prediction at each multiple of the full run's tokens, with its interval."""
    return [
        {
            "data_multiple": m,
            "train_tokens": int(t),
            "tau": round(fitted.tau(t), 4),
            "interval": _round(iv),
        }
        for m, t, iv in zip(multiples, targets, intervals, strict=True)
    ]


def fitted_on(verifier: vf.VerifierFacts) -> dict[str, Any]:
    """The verifier the curve is measured on: its identity (name, revision, config.json's
    sha256) and its text model's shape, what a plan compares where it cannot hash the config."""
    return verifier.identity | verifier.shape_record


def _write(result: dict[str, Any]) -> None:
    atomic.write_json(paths.CURVE, result)
    _write_plots(result)
    for line in lc.summary_lines(result) + _fraction_epoch_lines(result):
        log(STAGE, line)


def _fraction_epoch_lines(result: dict[str, Any]) -> list[str]:
    """Each fraction's val acceptance by epoch and where it peaks (the full run's is in
    summary_lines)."""
    lines = []
    for p in result["points"]:
        taus = p["epochs"]["tau_by_epoch"]
        if p["fraction"] == 1.0 or not taus:
            continue
        lines.append(
            f"fraction {p['fraction']}: val acceptance by epoch: "
            f"{', '.join(f'{t:.3f}' for t in taus)} (peak at epoch "
            f"{p['epochs']['peak_epoch'] + 1} of {len(taus)})"
        )
    return lines


def _check(
    points: list[lc.Point], k: int, c: Any, seed: int, form: str = "line"
) -> dict[str, Any] | None:
    """The `form` fitted on the smaller points, predicting the largest: does it hold here?"""
    smaller, largest = points[:-1], points[-1]
    if len({p.train_tokens for p in smaller}) < lc.MIN_TOKEN_COUNTS[form]:
        return None
    f = lc.FORMS[form]([p.train_tokens for p in smaller], [p.tau for p in smaller], k)
    _, iv = lc.bootstrap(
        smaller, k, [largest.train_tokens], c.bootstrap_samples, c.confidence, seed, form
    )
    predicted = f.tau(largest.train_tokens)
    return {
        "fitted_on": [p.fraction for p in smaller],
        "train_tokens": largest.train_tokens,
        "predicted": round(predicted, 4),
        "interval": _round(iv[0]),
        "measured": round(largest.tau, 4),
        # not "error": `dvc metrics show` takes any key of that name for a failure to load
        "difference": round(predicted - largest.tau, 4),
    }


def measure_on(params: Params, model_dir: Path, ids: Collection[str]) -> dict[str, Any]:
    """A drafter simulated on the val samples among `ids` (e.g. an earlier, smaller run's val
    samples, which the split keeps in val when rows are added: prepare.is_val hashes the id):
    the figure that compares with a curve fitted on those samples. {"num_samples", "missing"
    (ids not among this store's val samples), "tau", "per_sample"}."""
    facts = vf.read_verifier(params.verifier)
    found, counts = _simulate(params, facts, {"model": model_dir}, only=set(ids))
    got = counts["model"]
    return {
        "num_samples": len(found),
        "missing": sorted(set(ids) - set(found)),
        "tau": round(lc.tau_of(sum(got.drafts), sum(got.accepted)), 4),
        "per_sample": {"drafts": got.drafts, "accepted": got.accepted},
    }


def val_ids(val: Collection[str], max_samples: int | None, only: set[str] | None) -> list[str]:
    """The val samples simulated, by id: the first `max_samples` (evaluate.max_offline_samples,
    None = all), or every one in `only`."""
    if not val:
        raise StoreError(f"{paths.HIDDEN_STATES}: no val samples: raise prepare.val_ratio")
    if only is not None:
        return sorted(set(val) & only)
    return sorted(val)[:max_samples]


def _simulate(
    params: Params,
    verifier: vf.VerifierFacts,
    dirs: dict[str, Path],
    only: set[str] | None = None,
) -> tuple[list[str], dict[str, Counts]]:
    """(the val ids, per model: counts per val sample) as evaluate simulates them: the first
    evaluate.max_offline_samples val samples by id (`only`: those of them in `only`, however
    many), greedy tokens computed once per sample."""
    config = verifier.text
    conventions = run_conventions(params.layers, params.train, verifier.num_layers)
    manifest = store.read_manifest(paths.HIDDEN_STATES)
    positions = store.check_layout(
        manifest, conventions.aux_layer_ids, conventions.final_layer_id, paths.HIDDEN_STATES
    )
    val = {sid: e for sid, e in manifest["samples"].items() if e["split"] == "val"}
    ids = val_ids(val, params.evaluate.max_offline_samples, only)
    device, dtype = drafter.compute_placement()
    models = {
        name: drafter.load_drafter(path, params.verifier.path, device, dtype)
        for name, path in dirs.items()
    }
    head = offline.VerifierHead(
        params.verifier.path, float(config.get("rms_norm_eps", 1e-6)), device, dtype
    )
    k = params.evaluate.num_speculative_tokens
    counts = {n: Counts([], []) for n in models}
    progress = Progress(STAGE, len(ids), unit="samples")
    for sid in ids:
        t = store.read_sample(paths.HIDDEN_STATES, val[sid], layers=positions)
        hs, tokens, mask = t["hidden_states"], t["token_ids"], t["loss_mask"]
        greedy = head.greedy(hs[:, -1])
        for name, model in models.items():
            prefix = offline.accepted_prefix(
                offline.draft_matches(model, hs, tokens, greedy, k), mask
            )
            counts[name].drafts.append(int(prefix.shape[0]))
            counts[name].accepted.append(int(prefix.sum()))
        progress.advance()
    return ids, counts


def _train_rows(params: Params, fraction: float | None) -> list[dict]:
    rows = readers.read_jsonl(paths.TOKENIZED / "train.jsonl")
    if fraction is None:
        return rows
    ratio = params.prepare.val_ratio
    return [r for r in rows if split.in_fraction(r["id"], fraction, ratio)]


def _record(
    params: Params, fraction: float, rows: list[dict], ids: list[str], counts: Counts
) -> dict[str, Any]:
    return {
        "fraction": fraction,
        "num_speculative_tokens": params.evaluate.num_speculative_tokens,
        "train_samples": len(rows),
        "train_tokens": sum(len(r["input_ids"]) for r in rows),
        "supervised_tokens": sum(sum(r["loss_mask"]) for r in rows),
        "val_ids_sha256": _ids_hash(ids),
        "tau": round(lc.tau_of(sum(counts.drafts), sum(counts.accepted)), 4),
        "per_sample": {"drafts": counts.drafts, "accepted": counts.accepted},
    }


# What the fit reads of a fraction's eval.json (measure writes them all).
FRACTION_KEYS = ("fraction", "train_samples", "train_tokens", "per_sample")


def _read_fraction(fraction: float, full: dict[str, Any]) -> dict[str, Any]:
    path = paths.CURVE_FRACTIONS / str(fraction) / "eval.json"
    if not path.is_file():
        raise DataError(f"{path}: not found: run the stage curve_train@{fraction}")
    rerun = f"rerun curve_train@{fraction} (dvc repro -f curve_train@{fraction})"
    record = readers.read_json_object(path, DataError, rerun)
    missing = [key for key in FRACTION_KEYS if key not in record]
    if missing:
        raise DataError(f"{path}: incomplete (no {', '.join(missing)}): {rerun}")
    for key in ("val_ids_sha256", "num_speculative_tokens"):
        if record.get(key) != full[key]:
            raise DataError(
                f"{path}: measured on other val samples or draft counts than the full run "
                f"({key}): rerun curve_train@{fraction} (dvc repro -f curve_train@{fraction})"
            )
    return record


def _val_tau_series(fraction: float) -> Path:
    """The val acceptance per epoch train's DVCLive series holds: the full run's (1.0) or
    fraction F's (curve_train@F publishes its series under metrics/fractions/F/train)."""
    if fraction == 1.0:
        return paths.TRAIN_VAL_TAU
    live = paths.CURVE_FRACTIONS / str(fraction) / "train"
    return live / paths.TRAIN_VAL_TAU.relative_to(paths.TRAIN_LIVE)


def _full_epochs() -> dict[str, Any]:
    return _epochs(paths.TRAIN_VAL_TAU) | {
        "source": "train's val (speculators' chained conditional accuracy)"
    }


def _epochs(series: Path) -> dict[str, Any]:
    """A run's val acceptance per epoch (speculators' validation: the chained conditional
    accuracies, teacher-forced), in the order the epochs ran; the epoch (from 0) where it peaks.
    No series (a run without val): none."""
    taus: list[float] = []
    if series.is_file():
        with open(series, newline="") as fh:
            taus = [float(r["acceptance_length"]) for r in csv.DictReader(fh, delimiter="\t")]
    peak = lc.peak_epoch(taus)
    return {
        "tau_by_epoch": [round(t, 4) for t in taus],
        "peak_epoch": peak,
        "peak_tau": round(taus[peak], 4) if peak is not None else None,
    }


def _write_plots(result: dict[str, Any]) -> None:
    series = {
        "measured": result["points"],
        "predicted": result["predictions"] or [],
        "predicted (bend)": (result.get("bend") or {}).get("predictions") or [],
    }
    tokens = [
        {"train_tokens": p["train_tokens"], "tau": p["tau"], "kind": kind}
        for kind, rows in series.items()
        for p in rows
    ]
    epochs = [{"epoch": i + 1, "tau": t} for i, t in enumerate(result["epochs"]["tau_by_epoch"])]
    atomic.write_json(paths.CURVE_TOKENS, tokens)
    atomic.write_json(paths.CURVE_EPOCHS, epochs)


def _ids_hash(ids: list[str]) -> str:
    return hashlib.sha256("\n".join(ids).encode()).hexdigest()


def _round(iv: tuple[float, float]) -> list[float]:
    return [round(iv[0], 4), round(iv[1], 4)]
