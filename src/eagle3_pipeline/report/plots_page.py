"""The page `dvc plots show` fills, with Vega inlined: DVC's own page loads Vega, Vega-Lite and
Vega-Embed from a CDN, so without network it draws a blank page.

`.dvc/config` names `.dvc/plots.html` (plots.html_template); this module writes that file from
vl-convert's bundle of the three libraries (the version the lock pins), and
tests/unit/report/test_plots_page.py holds the committed file to what it writes:
`python -m eagle3_pipeline.report.plots_page` after an upgrade of vl-convert.
"""

from __future__ import annotations

import sys
from pathlib import Path

from eagle3_pipeline.core import atomic

PAGE = Path(".dvc/plots.html")
# What DVC replaces in the page (dvc_render.html.HTML); `{scripts}` is left out on purpose:
# it is where DVC puts the CDN's <script src> tags.
PLACEHOLDERS = ("{plot_divs}", "{refresh_tag}")

_TEMPLATE = """<!DOCTYPE html>
<html>
<head>
    {refresh_tag}
    <meta charset="utf-8">
    <title>eagle3-pipeline plots (dvc plots show)</title>
    <script type="text/javascript">
    // Vega, Vega-Lite and Vega-Embed (vl-convert's bundle), in a function scope so its
    // top-level names cannot clash with the plots' inline scripts; it sets window.vegaEmbed.
    (function () {
BUNDLE
    })();
    </script>
    <style>
        table { border-spacing: 15px; }
    </style>
</head>
<body>
    {plot_divs}
</body>
</html>
"""


def page() -> str:
    """The template's text: DVC's placeholders, and the bundle that draws without network."""
    import vl_convert

    bundle = vl_convert.javascript_bundle()
    clashes = [p for p in (*PLACEHOLDERS, "{scripts}", "</script") if p in bundle]
    if clashes:  # DVC would substitute inside the bundle, or the tag would end early
        raise ValueError(f"vl-convert's bundle holds {clashes}: the page cannot inline it")
    return _TEMPLATE.replace("BUNDLE", bundle)


def main() -> int:
    atomic.write_text(PAGE, page())
    print(f"{PAGE}: written ({PAGE.stat().st_size:,} bytes); commit it", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
