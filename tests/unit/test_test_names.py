"""Where a test lives: tests/unit/ mirrors the code, so a module's unit test is found by its path.

Test modules are imported by their path (pytest's importlib import mode, pyproject.toml), so two
test packages may hold files of one name. Every file under tests/unit/<package>/ is named after a
module of src/eagle3_pipeline/<package>/ (or of scripts/, bench/ for tests/unit/scripts/ and
tests/unit/bench/): `test_<module>.py`, or `test_<module>_<topic>.py` beside it. Files directly in
tests/unit/ test the repository's own files (dvc.yaml, Dockerfile, docs, this layout), no module.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent
PKG = REPO / "src/eagle3_pipeline"
# Test folders for code outside the package: the folder of the files they test.
OUTSIDE = {"scripts": REPO / "scripts", "bench": REPO / "bench"}


def _modules(folder: Path) -> set[str]:
    return {p.stem for p in folder.glob("*.py") if p.name != "__init__.py"}


def _named_after(test: Path, modules: set[str]) -> bool:
    name = test.stem.removeprefix("test_")
    return any(name == m or name.startswith(f"{m}_") for m in modules)


def test_test_modules_are_imported_by_path() -> None:
    """Importlib mode: same-named files in two test packages both import (the default mode
    imports by basename, and two files of one name stop the whole collection)."""
    options = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert "--import-mode=importlib" in options["addopts"].split()


def test_every_unit_test_is_named_after_a_module_of_its_folder() -> None:
    misplaced = []
    for folder in sorted(p for p in (TESTS / "unit").iterdir() if p.is_dir()):
        code = OUTSIDE.get(folder.name, PKG / folder.name)
        assert code.is_dir(), f"tests/unit/{folder.name}/ mirrors no folder of the code"
        modules = _modules(code)
        for test in sorted(folder.rglob("test_*.py")):
            if not _named_after(test, modules):
                misplaced.append(str(test.relative_to(TESTS)))
    assert misplaced == []


def test_top_level_unit_tests_name_no_module() -> None:
    """A test of a package module lives in that package's test folder, not at the top."""
    modules = {m for p in PKG.iterdir() if p.is_dir() for m in _modules(p)} | _modules(PKG)
    modules -= {"cli"}  # the CLI is exercised by the tests of what it runs
    top = [p for p in (TESTS / "unit").glob("test_*.py") if _named_after(p, modules)]
    assert top == []
