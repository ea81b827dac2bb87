"""`make report [REVS="HEAD~1 HEAD"]`: the run's charts in one HTML file that needs no network.

Draws every plot dvc.yaml declares: DVC's own filled specs for the training series, and the
summary plots (served acceptance per prompt set, acceptance per position, throughput, stage
durations, store) from series derived at each revision (series.py). Also writes a PNG per chart
and the workspace's summary series (metrics/report/*.json, the files dvc.yaml's summary plots
read). Not a DVC stage: it reads
outputs, writes none, and no stage imports it.
"""

from __future__ import annotations

import argparse
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from eagle3_pipeline.core import atomic
from eagle3_pipeline.core.errors import PipelineError
from eagle3_pipeline.evaluation import speedup
from eagle3_pipeline.report import comparison, render, series, sources

OUT_DIR = Path("report")
SUMMARY = "Summary: served acceptance, acceptance, throughput, durations, store"
TRAINING = "Training (DVCLive series, as `dvc plots show` draws them)"


def write_series(derived: dict[str, series.Records]) -> list[Path]:
    """The workspace's summary series, for `dvc plots show|diff` (dvc.yaml's summary plots)."""
    written = [atomic.write_json(series.SERIES_DIR / f"{n}.json", derived[n]) for n in series.NAMES]
    for path in written:
        path.chmod(0o644)
    return written


def _durations_note(per_rev: dict[str, dict[str, series.Records]]) -> str:
    missing = {
        rev: [r["label"] for r in d["durations"] if r["value"] is None]
        for rev, d in per_rev.items()
    }
    parts = [f"{rev}: {', '.join(m)}" for rev, m in missing.items() if m]
    return (
        "no duration_s in the provenance record (a stage run before it was recorded) for "
        + "; ".join(parts)
        if parts
        else ""
    )


def charts(
    defs: list[sources.PlotDef],
    per_rev: dict[str, dict[str, series.Records]],
    dvc_specs: dict[str, dict[str, Any]],
) -> list[render.Chart]:
    """One chart per dvc.yaml plot, in dvc.yaml's order, summary ones first."""
    out: list[render.Chart] = []
    for d in [d for d in defs if d.series] + [d for d in defs if not d.series]:
        if d.series:
            records = [{**r, "rev": rev} for rev, s in per_rev.items() for r in s[d.series]]
            if records and all(r.get("value", 0) is None for r in records):
                out.append(render.Chart(d.id, SUMMARY, None, _durations_note(per_rev)))
                continue
            if not records:
                out.append(render.Chart(d.id, SUMMARY, None, f"no {d.series} data in any revision"))
                continue
            template = d.props.get("template")
            spec = render.fill_template(template, records, d.props, d.id)
            note = _durations_note(per_rev) if d.series == "durations" else ""
            out.append(render.Chart(d.id, SUMMARY, spec, note))
        elif d.id in dvc_specs:
            out.append(render.Chart(d.id, TRAINING, dvc_specs[d.id]))
        else:
            out.append(render.Chart(d.id, TRAINING, None, "DVC found no data for it (see below)"))
    return out


def headline(files: dict[str, sources.RevisionFiles]) -> tuple[list[str], list[list[str]]]:
    """Mean acceptance length and acceptance rate of every drafter, and online throughput; the
    `families` branches' drafters served the same way, one row each (the comparison table)."""
    head = ["revision", "drafter", "mode", "mean acceptance length", "acceptance rate", "speedup"]
    rows: list[list[str]] = []
    for rev, f in files.items():
        ev = f.eval or {}
        offline = ev.get("offline") or {}
        for name in sorted(offline, key=series.drafter_key):
            rows.append(_headline_row(rev, name, "offline", offline[name]))
        online = ev.get("online") or {}
        if "mean_acceptance_length" in online:
            rows.append(_headline_row(rev, "trained", "online (vLLM)", online))
            rows += _best_row(rev, "trained", online)
        for name, doc in sorted(f.families.items()):
            label = f"{name} ({doc.get('family', '?')})"
            simulated = (doc.get("offline") or {}).get("trained")  # as its family drafts
            if isinstance(simulated, dict):
                rows.append(_headline_row(rev, label, "offline", simulated))
            rows.append(_headline_row(rev, label, "online (vLLM)", doc.get("online") or {}))
            rows += _best_row(rev, label, doc.get("online") or {})
    return head, rows


def _best_row(rev: str, drafter: str, online: dict[str, Any]) -> list[list[str]]:
    """The drafter at its best draft count (evaluate.num_speculative_tokens_sweep), if swept."""
    best = online.get("best_num_speculative_tokens")
    row = (online.get("by_num_speculative_tokens") or {}).get(str(best))
    if not isinstance(row, dict):
        return []
    return [_headline_row(rev, drafter, f"online (vLLM), best: {best} drafts", row)]


def _headline_row(rev: str, drafter: str, mode: str, r: Any) -> list[str]:
    """One row: a summary's acceptance figures, and its speedup where it was served (the
    median of paired rounds, or "none (spread S)" where they spread too wide to trust)."""
    r = r if isinstance(r, dict) else {}
    served = speedup.cell(r)
    return [
        rev,
        drafter,
        mode,
        comparison.number(r.get("mean_acceptance_length"), ".3f"),
        comparison.number(r.get("acceptance_rate"), ".1%"),
        served.removeprefix("x") if mode != "offline" else "",
    ]


def build(revs: list[str], out_dir: Path = OUT_DIR) -> Path:
    """Write out_dir/index.html and out_dir/png/*.png; return the HTML's path."""
    labels = revs or [sources.WORKSPACE]
    files = {rev: sources.read_revision(rev) for rev in labels}
    workspace = files.get(sources.WORKSPACE) or sources.read_revision(sources.WORKSPACE)
    write_series(series.derive(workspace.eval, workspace.provenance, workspace.manifest))
    per_rev = {rev: series.derive(f.eval, f.provenance, f.manifest) for rev, f in files.items()}
    specs, dvc_errors = sources.dvc_plot_specs(revs)
    problems = [f"{f.rev}: {p}" for f in files.values() for p in f.problems]
    problems += [f"dvc plots: {e}" for e in dvc_errors if "metrics/report/" not in e]
    drawn: list[tuple[render.Chart, str | None]] = []
    for chart in charts(sources.plot_defs(), per_rev, specs):
        svg = render.draw(chart, out_dir / "png")[0] if chart.spec is not None else None
        drawn.append((chart, svg))
    meta = [
        f"revisions: {', '.join(labels)}; written {datetime.now(UTC).isoformat(timespec='seconds')}"
        " by `make report`; every chart is also a PNG in png/ beside this file.",
    ]
    for rev, f in files.items():
        rec = f.provenance.get("evaluate") or {}
        if rec:
            meta.append(
                f"{rev}: evaluate ran at commit {str(rec.get('git_commit'))[:12]}, profile "
                f"{rec.get('profile')}, recorded {rec.get('recorded_at')}"
            )
    html = render.page("eagle3-pipeline run report", meta, headline(files), drawn, problems)
    path = atomic.write_text(out_dir / "index.html", html)
    ignore = out_dir / ".gitignore"  # rendered from committed files: never committed itself
    if not ignore.exists():
        ignore.write_text("# written by `make report` (eagle3_pipeline.report.build)\n*\n")
    for written in [path, *(out_dir / "png").glob("*.png")]:
        written.chmod(0o644)  # a report is for reading by others (temp files are 0600)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m eagle3_pipeline.report.build", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--revs",
        nargs="*",
        default=[],
        help="git revisions or experiments to compare "
        "(default: the workspace); as `dvc plots diff` takes them",
    )
    parser.add_argument("--out", type=Path, default=OUT_DIR, help="folder to write (report/)")
    args = parser.parse_args(argv)
    try:
        path = build(args.revs, args.out)
    except PipelineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"report: {path.resolve()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
