"""`make report`: every dvc.yaml plot drawn offline, the same data DVC draws, revisions compared."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from report_fixtures import commit, make_repo, run, write_metrics

from eagle3_pipeline.report import build, sources

# src/href/url() pointing anywhere but this file: a page that would load from the network.
REMOTE = re.compile(
    r"""(?:src|href)\s*=\s*["']?\s*(?:https?:)?//|url\(\s*["']?(?:https?:)?//""", re.I
)


def _plot_ids() -> list[str]:
    return [next(iter(p)) for p in yaml.safe_load(Path("dvc.yaml").read_text())["plots"]]


def _chart_data(html: str) -> dict[str, str]:
    return dict(
        re.findall(r'<figure class="chart" data-chart="([^"]+)">(<svg.*?</svg>)', html, re.S)
    )


@pytest.fixture
def repo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = make_repo(tmp_path / "r")
    monkeypatch.chdir(root)
    return root


def test_every_declared_plot_is_drawn_as_svg_and_png_with_nothing_remote(repo: Path) -> None:
    path = build.build([])
    html = path.read_text()
    drawn = _chart_data(html)
    assert sorted(drawn) == sorted(_plot_ids()) and len(drawn) == 16
    for pid, svg in drawn.items():
        assert re.search(r"<(path|rect)\b", svg), pid  # marks, not an empty frame
        assert (repo / "report/png" / f"{build.render.slug(pid)}.png").stat().st_size > 1000
    assert "<script" not in html and not REMOTE.search(html)
    assert "report/index.html" not in run(repo, "git", "status", "--porcelain", "-uall")
    assert REMOTE.search('<img src="https://cdn.example/x.png">')  # the scan can fail


def test_summary_plots_draw_what_dvc_plots_draws(repo: Path) -> None:
    """The report fills dvc.yaml's summary plots itself (per revision); for the workspace its
    specs carry exactly the records `dvc plots show` reads from metrics/report/."""
    build.build([])
    dvc_specs, errors = sources.dvc_plot_specs([])
    assert not errors
    defs = {d.id: d for d in sources.plot_defs()}
    per_rev = {"workspace": build.series.derive(*_raw("workspace"))}
    for chart in build.charts(list(defs.values()), per_rev, dvc_specs):
        if not defs[chart.id].series:
            assert chart.spec is dvc_specs[chart.id]
            continue
        dvc_rows = [
            {k: v for k, v in r.items() if k not in ("filename", "field")}
            for r in dvc_specs[chart.id]["data"]["values"]
        ]
        assert chart.spec["data"]["values"] == dvc_rows, chart.id
        assert {k: v for k, v in chart.spec.items() if k != "data"} == {
            k: v for k, v in dvc_specs[chart.id].items() if k != "data"
        }, chart.id


def _raw(rev: str) -> tuple:
    f = sources.read_revision(rev)
    return f.eval, f.provenance, f.manifest


def test_revisions_are_compared_from_their_own_files(repo: Path) -> None:
    write_metrics(repo, scale=0.5)
    commit(repo, "second")
    html = build.build(["HEAD~1", "HEAD"]).read_text()
    drawn = _chart_data(html)
    assert sorted(drawn) == sorted(_plot_ids())
    # the acceptance chart holds both revisions' numbers (rows facet by revision)
    svg = drawn["acceptance per draft position"]
    assert "HEAD~1" in svg and "HEAD" in svg
    rows = re.findall(
        r"<td>(HEAD~1|HEAD)</td><td>trained</td><td>offline</td><td>([0-9.]+)</td>", html
    )
    assert dict(rows) == {"HEAD~1": "3.000", "HEAD": "2.000"}
    # the workspace's series (what dvc plots diff reads) follow the workspace, not HEAD~1
    ws = json.loads((repo / "metrics/report/throughput.json").read_text())
    assert ws == [
        {"label": "without drafter", "value": 150.0},
        {"label": "with drafter", "value": 100.0},
    ]


def test_unknown_revision_is_one_line_error(repo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert build.main(["--revs", "no-such-rev"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: revision 'no-such-rev'") and "\n" not in err


def test_family_branches_join_the_headline_table(repo: Path) -> None:
    """Each `families` branch served by vLLM is one row beside the EAGLE-3 drafter's, from the
    workspace and from a committed revision alike."""
    branch = repo / "metrics/families/pe"
    branch.mkdir(parents=True)
    online = {"mean_acceptance_length": 2.5, "acceptance_rate": 0.5, "speedup": 1.25}
    (branch / "eval.json").write_text(json.dumps({"family": "peagle", "online": online}))
    commit(repo, "a branch")
    for revs in ([], ["HEAD"]):
        html = build.build(revs).read_text()
        row = re.search(
            r"<td>pe \(peagle\)</td><td>online \(vLLM\)</td>((?:<td>[^<]*</td>){3})", html
        )
        assert row is not None, revs
        assert re.findall(r"<td>([^<]*)</td>", row.group(1)) == ["2.500", "50.0%", "1.25"]


def test_a_simulated_branch_gets_its_offline_row(repo: Path) -> None:
    """A DFlash branch simulated offline as it drafts: an offline row above its served one."""
    branch = repo / "metrics/families/df"
    branch.mkdir(parents=True)
    doc = {
        "family": "dflash",
        "offline": {"trained": {"mean_acceptance_length": 3.1, "acceptance_rate": 0.7}},
        "online": {"mean_acceptance_length": 3.25, "acceptance_rate": 0.75, "speedup": 1.4},
    }
    (branch / "eval.json").write_text(json.dumps(doc))
    html = build.build([]).read_text()
    cells = re.findall(r"<td>df \(dflash\)</td><td>([^<]*)</td><td>([^<]*)</td>", html)
    assert cells == [("offline", "3.100"), ("online (vLLM)", "3.250")]


def test_a_swept_drafter_gets_its_best_count_row(repo: Path) -> None:
    """With evaluate.num_speculative_tokens_sweep, each drafter's row at its best count (the most
    tokens/s) follows its row at the common count: every family at its best."""
    branch = repo / "metrics/families/df"
    branch.mkdir(parents=True)
    by = {
        "3": {"mean_acceptance_length": 3.25, "acceptance_rate": 0.75, "speedup": 1.4},
        "7": {"mean_acceptance_length": 4.5, "acceptance_rate": 0.5, "speedup": 1.9},
    }
    online = by["3"] | {"by_num_speculative_tokens": by, "best_num_speculative_tokens": 7}
    (branch / "eval.json").write_text(json.dumps({"family": "dflash", "online": online}))
    html = build.build([]).read_text()
    cells = re.findall(r"<td>df \(dflash\)</td><td>([^<]*)</td><td>([^<]*)</td>", html)
    assert cells == [("online (vLLM)", "3.250"), ("online (vLLM), best: 7 drafts", "4.500")]
    assert "1.90" in html


def test_a_speedup_without_a_figure_says_so_in_the_headline() -> None:
    """Paired rounds that spread too wide: the headline says so instead of a figure; a trusted
    one shows the median as before."""
    wide = {
        "mean_acceptance_length": 2.5,
        "acceptance_rate": 0.5,
        "speedup": None,
        "speedup_trusted": False,
        "speedup_spread": 0.48,
        "speedup_rounds": [1.0, 1.3, 1.48, 1.2, 1.25],
    }
    tight = wide | {"speedup": 1.25, "speedup_trusted": True, "speedup_spread": 0.08}
    files = sources.RevisionFiles(
        "workspace", eval={"online": tight}, families={"pe": {"family": "peagle", "online": wide}}
    )
    _, rows = build.headline({"workspace": files})
    assert rows[0][2:] == ["online (vLLM)", "2.500", "50.0%", "1.25"]
    assert rows[1][1:] == ["pe (peagle)", "online (vLLM)", "2.500", "50.0%", "none (spread 0.48)"]
