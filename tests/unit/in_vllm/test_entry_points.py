"""in_vllm.entry_points: every name vLLM loads from the wing resolves to a module and class of
it, and no other file of the package spells one (a moved module breaks this test, not a server)."""

from __future__ import annotations

import ast

from eagle3_pipeline.harness import stage_deps
from eagle3_pipeline.in_vllm import entry_points

PKG = stage_deps.PKG


def _strings(path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {
        n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
    }


def test_every_entry_point_names_a_module_or_class_of_the_wing() -> None:
    assert set(entry_points.ALL) == {
        v for k, v in vars(entry_points).items() if k.isupper() and isinstance(v, str)
    }
    for name in entry_points.ALL:
        file = stage_deps.module_file(name)
        if not file.is_file():  # module.Class
            module, _, cls = name.rpartition(".")
            file = stage_deps.module_file(module)
            classes = {
                n.name for n in ast.walk(ast.parse(file.read_text())) if isinstance(n, ast.ClassDef)
            }
            assert cls in classes, f"{name}: no class {cls} in {file}"
        assert file.parent == PKG / "in_vllm", name


def test_no_other_file_spells_a_name_of_the_wing() -> None:
    spelled = {
        str(path.relative_to(PKG))
        for path in PKG.rglob("*.py")
        if path.name != "entry_points.py" and stage_deps.named(path)
    }
    assert spelled == set()
    assert set(entry_points.ALL) <= _strings(PKG / "in_vllm/entry_points.py")


def test_a_stage_that_starts_vllm_depends_on_every_module_it_may_load() -> None:
    deps = stage_deps.closure("eagle3_pipeline.stages.generate")
    guests = {p for p in (PKG / "in_vllm").glob("*.py") if p.name != "__init__.py"}
    assert guests <= deps
