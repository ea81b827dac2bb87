"""dvc.yaml lists, per stage, exactly the package modules that stage imports (transitively)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
import dvc_deps  # noqa: E402

PKG = dvc_deps.PKG
STAGES = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]


@pytest.mark.parametrize("stage", sorted(STAGES))
def test_stage_deps_match_imports(stage: str) -> None:
    """Fix with `python scripts/dvc_deps.py`."""
    deps = {d.replace("${pkg}", "src/eagle3_pipeline") for d in STAGES[stage]["deps"]}
    code_deps = {REPO / d for d in deps if d.endswith(".py")}
    assert code_deps == dvc_deps.closure(f"eagle3_pipeline.stages.{stage}")
    assert STAGES[stage]["cmd"] == f"eagle3 {stage} --params params.yaml"


def test_package_modules_count_as_deps(tmp_path: Path) -> None:
    """`from eagle3_pipeline.training import checkpoints` depends on training/checkpoints.py."""
    src = tmp_path / "m.py"
    src.write_text(
        "from eagle3_pipeline.training import checkpoints\n"
        "from eagle3_pipeline import paths\n"
        "from eagle3_pipeline.params import Params\n"
    )
    assert dvc_deps.imports(src) == {
        "eagle3_pipeline.training.checkpoints",
        "eagle3_pipeline.paths",
        "eagle3_pipeline.params",
    }


def test_stages_never_import_each_other() -> None:
    for f in (PKG / "stages").glob("*.py"):
        assert not any(m.startswith("eagle3_pipeline.stages") for m in dvc_deps.imports(f)), f
    shared = [f for f in PKG.rglob("*.py") if "stages" not in f.parts and f.name != "cli.py"]
    for f in shared:
        assert not any(m.startswith("eagle3_pipeline.stages") for m in dvc_deps.imports(f)), f


def test_every_init_is_empty() -> None:
    """A package __init__ with code would be imported by every stage below it, unlisted."""
    for init in PKG.rglob("__init__.py"):
        assert init.read_text().strip() == "", init
