"""The learning curve's part of `eagle3 plan`'s report: what curve.fractions adds, and the curve's
predictions costed in samples, disk and hours beside one more epoch (curve_cost.py)."""

from __future__ import annotations

from eagle3_pipeline.core import paths
from eagle3_pipeline.plan import curve_cost, modes, nodes
from eagle3_pipeline.plan.plan import Plan
from eagle3_pipeline.plan.report_text import millions, row, size, table

TRAIN_SCRATCH = paths.SCRATCH / "train"  # where the train stage keeps its epoch checkpoints


def fraction_lines(p: Plan) -> list[str]:
    """What curve.fractions adds: the fractions' training and checkpoints (in the totals), and
    in online mode the store they would need (curve_cost.fractions_cost)."""
    f = p.fractions
    if f is None:
        return []
    star = {m: " (*)" if m == p.hidden_states else "" for m in modes.MODES}
    hours = (
        f"+ {nodes.duration(f.train_s)} of training (curve_train, in the hours below)"
        if f.train_s is not None
        else "training time unknown (pass --prompts N)"
    )
    disk = (
        f"+ {size(f.checkpoint_bytes)} of checkpoints (each fraction {p.checkpoints_kept} kept "
        f"in {TRAIN_SCRATCH}-fF, best and final weights in {paths.CURVE_MODELS}/F; in the disk "
        "below)"
    )
    store = (
        f"+ {size(f.store_bytes)} ({p.store_dtype}) and {nodes.duration(f.store_extract_s)} "
        "of extract"
        if f.store_bytes is not None and f.store_extract_s is not None
        else "its size unknown (pass --prompts N)"
    )
    return [
        row(
            "fractions",
            f"curve.fractions {', '.join(map(str, f.fractions))}: train's drafter trained again "
            f"on each nested fraction of the same rows, {f.share:g} x train's training tokens",
        ),
        row("", f"store{star['store']}: {hours}; {disk}; no hidden states (they read the store)"),
        row(
            "",
            f"online{star['online']}: refused at load: the fractions read the store, which online "
            f"mode does not write; a curve there costs the store besides: {store}",
        ),
    ]


def curve_lines(p: Plan) -> list[str]:
    """The learning curve's predictions as samples, disk, prefill and hours (curve_cost.py);
    one line each where none is costed (none fitted, another verifier's)."""
    c = p.curve
    if c is None:
        return [row("curve" if i == 0 else "", n) for i, n in enumerate(p.curve_notes)]
    lines = [
        row(
            "curve",
            f"{paths.CURVE}: mean acceptance length {c.tau_now:.3f} at {c.tokens_now:,} "
            f"training tokens ({c.samples_now:,} samples)",
        )
    ]
    if c.fitted_on:
        lines.append(row("", c.fitted_on))
    if c.check:
        lines.append(
            row(
                "",
                f"fit check: fractions {', '.join(map(str, c.check['fitted_on']))} predicted "
                f"{c.check['predicted']:.3f} there, measured {c.check['measured']:.3f}",
            )
        )
    rows = [
        [
            "for",
            "tau",
            "train tokens",
            "samples",
            "store disk",
            "online disk",
            "prefill store/online",
            "hours store",
            "hours online",
        ]
    ]
    for r in c.rows:
        lo_hi = f" [{r.interval[0]:.2f}, {r.interval[1]:.2f}]" if r.interval else ""
        tau = f"{r.tau:.3f}{lo_hi}"
        disk = p.disk_bytes(r.scale.store)[p.store_dtype]
        online = p.disk_bytes(r.scale.online)[p.store_dtype]
        store_h = r.hours["generate"] + r.hours["extract"] + r.hours["train"]
        online_h = r.hours["generate"] + r.hours["train_online"]
        rows.append(
            [
                r.label,
                tau,
                millions(r.train_tokens),
                f"{r.scale.samples:,}",
                size(disk),
                size(online),
                f"{millions(r.scale.store.prefill_tokens)}/{millions(r.scale.online.prefill_tokens)}",
                f"{store_h:.1f}",
                f"{online_h:.1f}",
            ]
        )
    lines += table(rows, left={0})
    lines += [row("", n) for n in c.notes]
    lines += _trade_lines(c)
    lines.append(
        row(
            "",
            f"hours: generate + extract + train (online: generate + train with its prefill), "
            f"at {c.rates.generate:,.0f} / {c.rates.extract:,.0f} / {c.rates.train:,.0f} tokens/s:"
            f" {c.rates.source}",
        )
    )
    return lines


def _trade_lines(c: curve_cost.CurvePlan) -> list[str]:
    """One more epoch against 2x the data, side by side: what each buys and costs from here."""
    rows = [["from this run", "buys (mean acceptance length)", "hours store", "hours online", ""]]
    for t in c.trade:
        rows.append(
            [t.label, t.buys, f"{t.hours['store']:.1f}", f"{t.hours['online']:.1f}", t.reruns]
        )
    lines = table(rows, left={0, 1, 4})
    return lines + ([row("", c.peaks)] if c.peaks else [])
