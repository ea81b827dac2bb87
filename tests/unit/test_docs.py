"""README.md and docs/*.md name only what exists: make targets, eagle3 commands, files, profiles.

Commands are read from code (fenced blocks and `inline spans`); links, doc paths, profiles and
package paths from the whole text. Each failure names the doc and what it names that is missing.
"""

from __future__ import annotations

import argparse
import re
import shlex
from functools import cache
from pathlib import Path

import pytest
import yaml

from eagle3_pipeline.cli import build_parser

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
DOCS = [README, *sorted((REPO / "docs").glob("*.md"))]
README_MAX_LINES = 280

FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
SPAN = re.compile(r"`([^`\n]+)`")
MAKE = re.compile(r"(?<![\w.-])make\s+(?=(.*))")  # each make of a line, with what follows
EAGLE3 = re.compile(r"(?<![\w.-])eagle3[ \t]+([^\s`]+)(?:[ \t]+([^\s`]+))?")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
DOC_PATH = re.compile(r"(?<![\w./-])docs/[\w./-]*?\.md\b")
PROFILE_PATH = re.compile(r"(?<![\w./-])profiles/([\w.-]+?)\.yaml\b")
PROFILE_VAR = re.compile(r"\bPROFILE=([\w.-]+)")
SRC_PATH = re.compile(r"(?<![\w./-])src/eagle3_pipeline/[\w./-]*")
TARGET_LINE = re.compile(r"^([A-Za-z0-9_.-]+(?:[ \t]+[A-Za-z0-9_.-]+)*)[ \t]*:(?!=)")
STOP = {"&&", "||", ";", "|", "&", "(", ")", "<", ">"}


def rel(doc: Path) -> str:
    return str(doc.relative_to(REPO))


def code_chunks(text: str) -> list[str]:
    """Fenced code blocks (line by line) and inline code spans of the prose around them."""
    chunks = [line for block in FENCE.findall(text) for line in block.splitlines()]
    prose = FENCE.sub("", text)
    return chunks + SPAN.findall(prose)


@cache
def make_targets() -> frozenset[str]:
    targets: set[str] = set()
    for line in (REPO / "Makefile").read_text().splitlines():
        if line.startswith(".PHONY:"):
            targets.update(line.split(":", 1)[1].split())
        elif (m := TARGET_LINE.match(line)) and not line.startswith((".", "\t")):
            targets.update(m.group(1).split())
    return frozenset(targets)


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


@cache
def cli_commands() -> dict[str, frozenset[str]]:
    """`eagle3` subcommands, each with its own subcommands (e.g. store -> verify)."""
    return {
        name: frozenset(_subcommands(sub)) for name, sub in _subcommands(build_parser()).items()
    }


def make_words(args: str) -> list[str]:
    """The words of a make command line after `make`, up to a shell operator or comment."""
    try:
        lexer = shlex.shlex(args, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        words = list(lexer)
    except ValueError:  # unbalanced quotes: plain words are good enough
        words = args.split()
    out = []
    for word in words:
        if word in STOP or word.startswith("#") or set(word) <= set("&|;()<>"):
            break
        out.append(word)
    return out


def make_targets_named(chunk: str) -> list[str]:
    """Targets of every `make ...` in one code line or span, ARGS='...' (make in the image) too."""
    named = []
    for m in MAKE.finditer(chunk):
        pending = make_words(m.group(1).split("`", 1)[0])  # a span inside a code block ends
        while pending:
            word = pending.pop(0)
            if word.startswith("ARGS="):
                pending[:0] = make_words(word.removeprefix("ARGS="))
            elif "=" not in word and not word.startswith(("-", "$", "<", "[")):
                named.append(word)
    return named


def eagle3_commands_named(chunk: str) -> list[tuple[str, str | None]]:
    named = []
    for m in EAGLE3.finditer(chunk):
        first, second = (w.rstrip(",.;:)") if w else w for w in m.groups())
        if first.startswith(("-", "<", "[")):
            continue
        if second is not None and second.startswith(("-", "<", "[")):
            second = None
        named.append((first, second))
    return named


def doc_text(doc: Path) -> str:
    return doc.read_text(encoding="utf-8")


@pytest.fixture(params=DOCS, ids=rel)
def doc(request: pytest.FixtureRequest) -> Path:
    return request.param


def test_docs_exist() -> None:
    assert README.is_file(), "README.md is missing"
    assert len(DOCS) > 1, "docs/ holds no *.md: the README points there for depth"


def test_make_targets_exist(doc: Path) -> None:
    targets = make_targets()
    missing = sorted(
        {t for chunk in code_chunks(doc_text(doc)) for t in make_targets_named(chunk)} - targets
    )
    assert not missing, (
        f"{rel(doc)} names make targets the Makefile lacks: {', '.join(missing)} "
        f"(Makefile targets: {', '.join(sorted(targets))})"
    )


def test_eagle3_commands_exist(doc: Path) -> None:
    commands = cli_commands()
    missing = set()
    for chunk in code_chunks(doc_text(doc)):
        for first, second in eagle3_commands_named(chunk):
            if first not in commands:
                missing.add(f"eagle3 {first}")
            elif commands[first] and second is not None and second not in commands[first]:
                missing.add(f"eagle3 {first} {second}")
    assert not missing, (
        f"{rel(doc)} names eagle3 commands the CLI lacks: {', '.join(sorted(missing))} "
        f"(`eagle3 --help` lists: {', '.join(sorted(commands))})"
    )


def test_links_and_doc_paths_exist(doc: Path) -> None:
    text = doc_text(doc)
    missing = set()
    for target in LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL or an anchor in the same page
        path = target.split("#", 1)[0]
        if not (doc.parent / path).exists():
            missing.add(f"link ({target})")
    for path in DOC_PATH.findall(text):
        if not (REPO / path).is_file():
            missing.add(path)
    assert not missing, (
        f"{rel(doc)} points to files that do not exist: {', '.join(sorted(missing))}"
    )


def test_profiles_exist(doc: Path) -> None:
    text = doc_text(doc)
    names = set(PROFILE_PATH.findall(text)) | {n.rstrip(".") for n in PROFILE_VAR.findall(text)}
    missing = sorted(n for n in names if not (REPO / "profiles" / f"{n}.yaml").is_file())
    have = sorted(p.stem for p in (REPO / "profiles").glob("*.yaml"))
    assert not missing, (
        f"{rel(doc)} names profiles that profiles/ lacks: {', '.join(missing)} "
        f"(profiles/: {', '.join(have)})"
    )


def test_package_paths_exist(doc: Path) -> None:
    named = {p.rstrip(".,:;") for p in SRC_PATH.findall(doc_text(doc))}
    missing = sorted(p for p in named if not (REPO / p).exists())
    assert not missing, f"{rel(doc)} names package paths that do not exist: {', '.join(missing)}"


def test_readme_fits_one_sitting() -> None:
    lines = len(doc_text(README).splitlines())
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines, more than {README_MAX_LINES}: move depth to docs/"
    )


def test_readme_shows_the_front_door_commands() -> None:
    named = {t for chunk in code_chunks(doc_text(README)) for t in make_targets_named(chunk)}
    for target in ("train", "test", "pull", "push"):
        assert target in named, f"README.md no longer shows `make {target}`"
    assert "PROFILE=kimi-k2.5" in doc_text(README), (
        "README.md no longer shows how to switch to the kimi-k2.5 profile"
    )


@pytest.mark.parametrize(
    ("chunk", "targets"),
    [
        ("make train PROFILE=<name>", ["train"]),
        ('make report REVS="HEAD~1 HEAD"', ["report"]),
        ("make push && git push   # dvc push", ["push"]),
        ("make docker ARGS='pull TARGETS=\"generate extract\"'", ["docker", "pull"]),
        ("make docker ARGS=gpu-check", ["docker", "gpu-check"]),
        ("SKIP_VENV=1 make profile plan PROFILE=x", ["profile", "plan"]),
        ("(make venv)", ["venv"]),
        ("make profile PROFILE=x && $EDITOR params.yaml && make train", ["profile", "train"]),
        ("cmake build", []),
        ("  report/   the run report (`make report`) and the summary", ["report"]),
    ],
)
def test_make_commands_are_read_as_make_reads_them(chunk: str, targets: list[str]) -> None:
    assert make_targets_named(chunk) == targets


def test_checks_see_what_is_missing() -> None:
    """The extractors find a wrong name in each kind of place a doc names things."""
    text = (
        "```bash\nmake no-such-target\neagle3 no-such-command\neagle3 store no-such-tool\n```\n"
        "See [x](no-such.md), `docs/no-such.md`, `profiles/no-such.yaml`, PROFILE=nope, "
        "`src/eagle3_pipeline/no_such.py`.\n"
    )
    chunks = code_chunks(text)
    assert "no-such-target" in {t for c in chunks for t in make_targets_named(c)}
    assert set(make_targets_named("make no-such-target")) - make_targets()
    assert ("no-such-command", None) in [e for c in chunks for e in eagle3_commands_named(c)]
    assert ("store", "no-such-tool") in [e for c in chunks for e in eagle3_commands_named(c)]
    assert "no-such.md" in LINK.findall(text)
    assert DOC_PATH.findall(text) == ["docs/no-such.md"]
    assert PROFILE_PATH.findall(text) == ["no-such"]
    assert PROFILE_VAR.findall(text) == ["nope"]
    assert SRC_PATH.findall(text) == ["src/eagle3_pipeline/no_such.py"]
    assert "verify" in cli_commands()["store"]


CLUSTER_TEMPLATES = sorted((REPO / "docs" / "cluster").glob("*"))


@pytest.mark.parametrize("template", CLUSTER_TEMPLATES, ids=rel)
def test_cluster_templates_name_what_exists(template: Path) -> None:
    """The Slurm and KubeRay templates (docs/cluster.md) run targets and profiles that exist."""
    text = doc_text(template)
    targets = {t for line in text.splitlines() for t in make_targets_named(line)}
    assert "train" in targets, f"{rel(template)} no longer runs `make train`"
    missing = sorted(targets - make_targets())
    missing += sorted(
        n for n in PROFILE_VAR.findall(text) if not (REPO / "profiles" / f"{n}.yaml").is_file()
    )
    assert not missing, f"{rel(template)} names what does not exist: {', '.join(missing)}"
    if template.suffix == ".yaml":
        (job,) = yaml.safe_load_all(text)
        assert job["kind"] == "RayJob" and "make train" in job["spec"]["entrypoint"]


def test_architecture_tree_names_every_module() -> None:
    """docs/architecture.md's tree is the one annotated tree of the package: each package with
    every module it holds, nothing that is gone."""
    tree = FENCE.findall(doc_text(REPO / "docs/architecture.md"))[0]
    listed: dict[str, set[str]] = {}
    package = ""
    for line in tree.splitlines()[1:]:
        if m := re.match(r"^  (\w+)/\s", line):
            package = m.group(1)
        elif re.match(r"^  \w+\.py\s", line):
            package = ""
        listed.setdefault(package, set()).update(re.findall(r"\b(\w+)\.py\b", line))
    pkg = REPO / "src/eagle3_pipeline"
    have = {
        p.name: {f.stem for f in p.glob("*.py")} - {"__init__"}
        for p in pkg.iterdir()
        if (p / "__init__.py").is_file()
    }
    have[""] = {p.stem for p in pkg.glob("*.py")} - {"__init__"}
    assert listed == have, "update docs/architecture.md's tree to the package as it is"


def test_readme_stage_table_is_dvc_yaml_in_order() -> None:
    """README's stage table names every stage of dvc.yaml, in its order: a `foreach` stage as
    `name@KEY` (one row for all its branches)."""
    text = doc_text(README)
    section = text[text.index("## Stages") :].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([\w@]+)` \|", section, re.M)
    stages = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    assert [r.split("@")[0] for r in rows] == list(stages), (
        f"README.md's stage table lists {rows}; dvc.yaml runs {list(stages)} (`make dag`)"
    )
    for row in rows:
        assert ("@" in row) == ("foreach" in stages[row.split("@")[0]]), row


def test_profiles_without_speedup_rounds_are_said_to_report_no_speed_up() -> None:
    """A profile with evaluate.speedup_rounds 0 measures no speed-up; README and
    docs/evaluation.md say which profiles those are."""
    silent = sorted(
        p.stem
        for p in (REPO / "profiles").glob("*.yaml")
        if (yaml.safe_load(p.read_text()).get("evaluate") or {}).get("speedup_rounds") == 0
    )
    assert silent, "no profile sets evaluate.speedup_rounds: 0: update README and evaluation.md"
    evaluation = doc_text(REPO / "docs/evaluation.md")
    missing = [p for p in silent if f"`{p}`" not in evaluation]
    assert not missing, f"docs/evaluation.md does not name {missing} as reporting no speed-up"
    assert all(p.startswith("kimi-") for p in silent), (
        f"README.md says the Kimi profiles are the ones without a speed-up; {silent} set 0"
    )
    assert "The Kimi profiles set `evaluate.speedup_rounds: 0`" in doc_text(README)


def test_make_dag_fits_a_page() -> None:
    """`make dag` (scripts/dag.py) prints every stage once, within 100 columns."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("dag", REPO / "scripts/dag.py")
    assert spec is not None and spec.loader is not None
    dag = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(dag)
    lines = dag.lines((REPO / "dvc.yaml").read_text())
    stages = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    assert [line.split()[0].split("@")[0] for line in lines[1:]] == list(stages)
    assert max(map(len, lines)) <= 100 and len(lines) <= 60
    assert "dag" in make_targets()
