"""Vega-Lite specs -> inline SVG + PNG (vl-convert: Vega bundled, no browser) -> one HTML page.

The page embeds each chart as SVG and loads nothing: no script, no stylesheet, no font, no image
from anywhere, so it opens the same on an offline GPU cluster as on a laptop. (`dvc plots show`
writes a page whose Vega scripts come from a CDN: blank without network.)
"""

from __future__ import annotations

import html
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dvc_render.vega_templates import get_template

from eagle3_pipeline.core import atomic


@dataclass
class Chart:
    """One chart of the report: where it comes from, its spec, and what to say under it."""

    id: str
    section: str
    spec: dict[str, Any] | None
    note: str = ""


def fill_template(template: str, records: list[dict[str, Any]], props: dict[str, Any], pid: str):
    """A dvc.yaml plot's custom template filled as DVC fills it (dvc_render's own anchors)."""
    t = get_template(template)
    y = props.get("y")
    y_field = next(iter(y.values())) if isinstance(y, dict) else y
    for name, value in (
        ("data", records),
        ("title", props.get("title", pid)),
        ("x_label", props.get("x_label", props.get("x", ""))),
        ("y_label", props.get("y_label", y_field or "")),
    ):
        if t.has_anchor(name):
            t.fill_anchor(name, value)
    return t.content


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", text.lower()).strip("_") or "chart"


def draw(chart: Chart, png_dir: Path) -> tuple[str, Path]:
    """(inline SVG, PNG path) of a chart."""
    import vl_convert

    svg = vl_convert.vegalite_to_svg(chart.spec)
    png = atomic.write_bytes(
        png_dir / f"{slug(chart.id)}.png", vl_convert.vegalite_to_png(chart.spec, scale=2)
    )
    return svg, png


CSS = """
body { font-family: sans-serif; margin: 1.5rem auto; max-width: 1400px; color: #222; }
h1 { font-size: 1.4rem; }
h2 { font-size: 1.15rem; margin-top: 2rem; border-bottom: 1px solid #ccc; }
.meta, figcaption, .note { color: #555; font-size: 0.85rem; }
.grid { display: flex; flex-wrap: wrap; gap: 1.5rem; }
figure.chart { margin: 0; max-width: 100%; }
figure.chart svg { max-width: 100%; height: auto; }
table { border-collapse: collapse; font-size: 0.9rem; }
td, th { border: 1px solid #ddd; padding: 0.25rem 0.6rem; text-align: right; }
th:first-child, td:first-child { text-align: left; }
.missing { border: 1px dashed #c66; padding: 1rem; color: #933; max-width: 420px; }
"""


def _table(rows: list[list[str]], head: list[str]) -> str:
    cells = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows
    )
    return f"<table><tr>{cells}</tr>{body}</table>"


def page(
    title: str,
    meta: list[str],
    headline: tuple[list[str], list[list[str]]],
    drawn: list[tuple[Chart, str | None]],
    problems: list[str],
) -> str:
    """The whole report: headline numbers, then each section's charts (SVG inline)."""
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{html.escape(title)}</title><style>{CSS}</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
        "".join(f'<p class="meta">{html.escape(m)}</p>' for m in meta),
    ]
    head, rows = headline
    if rows:
        parts += ["<h2>Headline numbers (metrics/eval.json)</h2>", _table(rows, head)]
    section = None
    for chart, svg in drawn:
        if chart.section != section:
            if section is not None:
                parts.append("</div>")
            section = chart.section
            parts.append(f'<h2>{html.escape(section)}</h2><div class="grid">')
        cid = html.escape(chart.id, quote=True)
        if svg is None:
            parts.append(f'<div class="missing" data-missing="{cid}">{html.escape(chart.id)}: ')
            parts.append(f"not drawn: {html.escape(chart.note)}</div>")
            continue
        caption = f"<figcaption>{html.escape(chart.note)}</figcaption>" if chart.note else ""
        parts.append(f'<figure class="chart" data-chart="{cid}">{svg}{caption}</figure>')
    if section is not None:
        parts.append("</div>")
    if problems:
        parts.append("<h2>What could not be read</h2><ul>")
        parts += [f'<li class="note">{html.escape(p)}</li>' for p in problems]
        parts.append("</ul>")
    parts.append("</body></html>")
    return "\n".join(parts)
