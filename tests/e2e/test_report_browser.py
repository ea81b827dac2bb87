"""The report in a real browser, offline: headless Chromium draws every chart and fetches nothing.

Chromium runs with every host unresolvable and a proxy on a closed port, so nothing from the
network could load; its NetLog lists every request the page made, and the test fails on any that
is not a file. A control page with one remote image proves the check sees
such a request. `.ci/run` installs Debian's `chromium`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from report_fixtures import REPO, make_repo

from eagle3_pipeline.report import build

pytestmark = pytest.mark.slow
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def _chromium(page: Path, netlog: Path, profile: Path) -> str:
    """The DOM after the page loaded (scripts, if any, ran), with networking off."""
    if CHROMIUM is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is not installed (.ci/run installs it)")
        pytest.skip("chromium is not installed (apt-get install chromium)")
    cmd = [
        CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
        f"--user-data-dir={profile}", "--proxy-server=127.0.0.1:9",
        "--host-resolver-rules=MAP * ~NOTFOUND", f"--log-net-log={netlog}",
        # Chromium's own background traffic (updates, sync, dictionaries) is not the page's:
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        "--disable-default-apps", "--disable-extensions", "--no-default-browser-check",
        "--virtual-time-budget=5000", "--dump-dom", page.resolve().as_uri(),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def _page_requests(netlog: Path) -> set[str]:
    """Every URL the page made Chromium request: NetLog's request starts whose network isolation
    key is the page's (file://). Chromium's own traffic (updater, clock, dictionaries) has other
    keys and is not the page's doing."""
    text = netlog.read_text()
    try:
        events = json.loads(text)["events"]
    except json.JSONDecodeError:  # killed before the closing bracket
        events = json.loads(text.rstrip().rstrip(",") + "]}")["events"]
    starts = [e.get("params") or {} for e in events]
    return {
        p["url"]
        for p in starts
        if "url" in p and str(p.get("network_isolation_key", "")).startswith("file://")
    }


def test_report_opens_offline_with_every_chart_drawn(tmp_path: Path, monkeypatch) -> None:
    root = make_repo(tmp_path / "r")
    monkeypatch.chdir(root)
    page = build.build([])
    ids = [next(iter(p)) for p in yaml.safe_load((root / "dvc.yaml").read_text())["plots"]]
    dom = _chromium(page, tmp_path / "net.json", tmp_path / "profile")
    figures = re.findall(
        r'<figure class="chart" data-chart="([^"]+)">\s*<svg(.*?)</svg>', dom, re.S
    )
    assert sorted(pid for pid, _ in figures) == sorted(ids)
    for pid, svg in figures:  # a drawn chart has marks and axis text, not an empty frame
        assert re.search(r"<(path|rect)\b", svg) and "<text" in svg, pid
    remote = {u for u in _page_requests(tmp_path / "net.json") if not u.startswith("file:")}
    assert remote == set(), remote


def test_dvc_plots_show_draws_every_chart_offline(tmp_path: Path, monkeypatch) -> None:
    """`dvc plots show` with the project's .dvc/config: its page inlines Vega (.dvc/plots.html)."""
    root = make_repo(tmp_path / "r")
    monkeypatch.chdir(root)
    build.build([])  # writes metrics/report/, the summary series (as make train does)
    shutil.copy(REPO / ".dvc/config", root / ".dvc/config")
    shutil.copy(REPO / ".dvc/plots.html", root / ".dvc/plots.html")
    subprocess.run(
        [sys.executable, "-m", "dvc", "plots", "show", "-o", "shown"],
        cwd=root,
        check=True,
        capture_output=True,
    )
    page = root / "shown/index.html"
    assert "cdn.jsdelivr" not in page.read_text()
    dom = _chromium(page, tmp_path / "net.json", tmp_path / "profile")
    plots = len(yaml.safe_load((root / "dvc.yaml").read_text())["plots"])
    charts = dom.split('class="vega-embed')[1:]  # each chart vega-embed drew, to the next one
    assert len(charts) == plots, (len(charts), plots, dom[-2000:])
    for chart in charts:  # drawn: marks and axis text, not an empty frame
        assert re.search(r'<svg[^>]*class="marks"', chart) and "<path" in chart, chart[:300]
        assert "<text" in chart, chart[:300]
    remote = {u for u in _page_requests(tmp_path / "net.json") if not u.startswith("file:")}
    assert remote == set(), remote


def test_the_network_check_sees_a_remote_load(tmp_path: Path) -> None:
    page = tmp_path / "control.html"
    page.write_text('<html><body><img src="http://report.invalid/x.png"></body></html>')
    _chromium(page, tmp_path / "net.json", tmp_path / "profile")
    assert _page_requests(tmp_path / "net.json") == {"http://report.invalid/x.png"}
