"""dvc.yaml lists, per stage, exactly the package modules that stage imports (transitively)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
PKG = REPO / "src/eagle3_pipeline"


def _module_file(name: str) -> Path:
    rel = name.removeprefix("eagle3_pipeline").lstrip(".").replace(".", "/")
    path = PKG / f"{rel}.py"
    return path if path.is_file() else PKG / rel / "__init__.py"


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.ImportFrom)
            and node.module
            and node.module.startswith("eagle3_pipeline")
        ):
            # `from pkg import mod` imports pkg/mod.py when mod is a module, not a name
            rel = node.module.removeprefix("eagle3_pipeline").lstrip(".").replace(".", "/")
            package = PKG / rel
            if package.is_dir():
                found |= {
                    f"{node.module}.{a.name}"
                    for a in node.names
                    if (package / f"{a.name}.py").is_file()
                }
            else:
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("eagle3_pipeline.")}
    return found


def _closure(module: str) -> set[Path]:
    seen: set[str] = set()
    todo = [module]
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        todo.extend(_imports(_module_file(m)))
    return {_module_file(m) for m in seen if _module_file(m).name != "__init__.py"}


STAGES = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]


@pytest.mark.parametrize("stage", sorted(STAGES))
def test_stage_deps_match_imports(stage: str) -> None:
    deps = {d.replace("${pkg}", "src/eagle3_pipeline") for d in STAGES[stage]["deps"]}
    code_deps = {REPO / d for d in deps if d.endswith(".py")}
    assert code_deps == _closure(f"eagle3_pipeline.stages.{stage}")
    assert STAGES[stage]["cmd"] == f"eagle3 {stage} --params params.yaml"


def test_stages_never_import_each_other() -> None:
    for f in (PKG / "stages").glob("*.py"):
        assert not any(m.startswith("eagle3_pipeline.stages") for m in _imports(f)), f
    shared = [f for f in PKG.rglob("*.py") if "stages" not in f.parts and f.name != "cli.py"]
    for f in shared:
        assert not any(m.startswith("eagle3_pipeline.stages") for m in _imports(f)), f
