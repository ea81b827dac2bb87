"""The page `dvc plots show` fills: committed, current, and Vega inlined."""

from __future__ import annotations

import configparser
from pathlib import Path

from dvc_render.html import HTML

from eagle3_pipeline.report import plots_page

REPO = Path(__file__).resolve().parents[3]


def test_dvc_config_names_the_committed_page_and_it_is_current() -> None:
    config = configparser.ConfigParser()
    config.read(REPO / ".dvc/config")
    assert config["plots"]["html_template"] == plots_page.PAGE.name
    committed = (REPO / plots_page.PAGE).read_text()
    assert committed == plots_page.page(), (
        "stale .dvc/plots.html: run `python -m eagle3_pipeline.report.plots_page` and commit it"
    )


def test_dvc_fills_the_page_without_cdn_scripts() -> None:
    html = HTML(plots_page.page())
    html.with_scripts('<script src="https://cdn.jsdelivr.net/npm/vega@5.20.2"></script>')
    html.with_element("<div id='p1'></div>")
    filled = html.embed()
    assert "<div id='p1'></div>" in filled and "{plot_divs}" not in filled
    assert "cdn.jsdelivr.net" not in filled  # DVC's script tags have nowhere to go
    assert "window.vegaEmbed=" in filled
