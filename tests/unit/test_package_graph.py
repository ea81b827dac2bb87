"""The package in pipeline order (DESIGN.md's layout): `cli.py` and packages at the top, each
package importing only packages below it, so the graph has no cycle and no upward import; no
module cycle inside a package either. Imports are read as the stages' DVC deps read them
(harness/stage_deps.py: every import, TYPE_CHECKING and function-local ones included)."""

from __future__ import annotations

from pathlib import Path

from eagle3_pipeline.harness import stage_deps

PKG = stage_deps.PKG
# Bottom first: a package may import the packages before it, never one after it.
ORDER = [
    "core",  # plumbing every layer uses
    "config",  # the params schema and what it validates with
    "conversations",  # prompt formats, files, chat template, turns, rows, synthesis
    "verifier",
    "in_vllm",  # what vLLM loads by name: server entry, auth, CPU patches, connectors
    "serving",  # vLLM from outside: servers, their watch, chat client, in-process engines
    "store",  # the hidden-state store and extraction
    "drafter",
    "cluster",  # the Ray engine
    "training",  # speculators' trainer and its launch
    "online_training",  # the vLLM servers an online run asks, started, checked, pooled
    "evaluation",
    "plan",
    "harness",  # what wraps every stage run
    "report",
    "stages",  # one module per DVC stage
    "cli",
]


def _module(path: Path) -> str:
    return "eagle3_pipeline." + ".".join(path.relative_to(PKG).with_suffix("").parts)


def _layer(module: str) -> str:
    return module.split(".")[1]


def _graph() -> dict[str, set[str]]:
    files = [p for p in PKG.rglob("*.py") if p.name != "__init__.py"]
    return {_module(p): stage_deps.imports(p) for p in files}


def test_the_top_is_cli_and_packages() -> None:
    top = {p.stem for p in PKG.glob("*.py") if p.name != "__init__.py"}
    assert top == {"cli"}
    packages = {p.name for p in PKG.iterdir() if (p / "__init__.py").is_file()}
    assert packages == set(ORDER) - {"cli"}, "place a new package in ORDER (and DESIGN.md)"


def test_no_package_imports_one_above_it() -> None:
    upward = sorted(
        f"{a} -> {b}"
        for a, imported in _graph().items()
        for b in imported
        if ORDER.index(_layer(b)) > ORDER.index(_layer(a))
    )
    assert upward == []


def test_no_module_cycle() -> None:
    graph = _graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles: list[list[str]] = []

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                cycles.append(path[path.index(n) :] + [n])
            elif n not in state:
                visit(n, [*path, n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert cycles == []
