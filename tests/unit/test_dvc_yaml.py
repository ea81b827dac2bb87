"""dvc.yaml lists, per stage, exactly the package modules that stage imports (transitively)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml
from builders import model_files

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
import dvc_deps  # noqa: E402

PKG = dvc_deps.PKG
STAGES = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]


# The commands of the stages that are not one plain `eagle3 <stage> --params params.yaml`: a
# `foreach` branch runs the module its command names, for one entry.
BRANCH_CMDS = {
    "family": "eagle3 train --params params.yaml --family ${key}",
    "family_eval": "eagle3 evaluate --params params.yaml --family ${key}",
    "curve_train": "eagle3 train --params params.yaml --fraction ${item} && "
    "eagle3 curve --params params.yaml --measure ${item}",
}


@pytest.mark.parametrize("stage", sorted(STAGES))
def test_stage_deps_match_imports(stage: str) -> None:
    """Fix with `python scripts/dvc_deps.py`. A stage's code deps are the import closure of
    every module its command runs (`eagle3 a ... && eagle3 b ...` runs two)."""
    body = STAGES[stage].get("do", STAGES[stage])
    deps = {d.replace("${pkg}", "src/eagle3_pipeline") for d in body["deps"]}
    code_deps = {REPO / d for d in deps if d.endswith(".py")}
    assert body["cmd"] == BRANCH_CMDS.get(stage, f"eagle3 {stage} --params params.yaml")
    modules = [part.split()[1] for part in body["cmd"].split(" && ")]
    assert code_deps == set().union(
        *(dvc_deps.closure(f"eagle3_pipeline.stages.{m}") for m in modules)
    )


def test_package_modules_count_as_deps(tmp_path: Path) -> None:
    """`from eagle3_pipeline.training import checkpoints` depends on training/checkpoints.py."""
    src = tmp_path / "m.py"
    src.write_text(
        "from eagle3_pipeline.training import checkpoints\n"
        "from eagle3_pipeline.core import paths\n"
        "from eagle3_pipeline.config.params import Params\n"
    )
    assert dvc_deps.imports(src) == {
        "eagle3_pipeline.training.checkpoints",
        "eagle3_pipeline.core.paths",
        "eagle3_pipeline.config.params",
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


def test_rewrite_keeps_a_foreach_stage_under_do() -> None:
    """`family@NAME` runs stages/train.py: its deps are train's code, indented under `do:`."""
    text = (
        "stages:\n  family:\n    foreach: ${families}\n    do:\n"
        "      cmd: eagle3 train --params params.yaml --family ${key}\n"
        "      deps:\n        - ${pkg}/stages/train.py\n        - data/vocab\n"
        "      outs:\n        - models/families/${key}\n"
    )
    new = dvc_deps.rewrite(text, ["family"])
    body = yaml.safe_load(new)["stages"]["family"]["do"]
    code = {d.replace("${pkg}", "src/eagle3_pipeline") for d in body["deps"] if d.endswith(".py")}
    assert {REPO / d for d in code} == dvc_deps.closure("eagle3_pipeline.stages.train")
    assert "data/vocab" in body["deps"] and body["outs"] == ["models/families/${key}"]


def _kimi_repo(tmp_path: Path, init_from: Path) -> Path:
    """A workspace with the tracked dvc.yaml and the kimi-k2.5 profile as params.yaml, its init
    checkpoint at `init_from` (outside the workspace, as /models/... is)."""
    raw = yaml.safe_load((REPO / "profiles/kimi-k2.5.yaml").read_text())
    raw["train"]["init_from"] = str(init_from)
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "params.yaml").write_text(yaml.safe_dump(raw))
    (repo / "dvc.yaml").write_text((REPO / "dvc.yaml").read_text())
    return repo


def test_make_train_with_a_kimi_profile_leaves_dvc_yaml_as_committed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """dvc.yaml is the same on every teammate's machine: a path param, e.g. the /models/...
    folder of train.init_from, never becomes one of its deps."""
    init = model_files(tmp_path / "models/AQ-MedAI-Kimi-K25-eagle3", config={})
    repo = _kimi_repo(tmp_path, init)
    assert dvc_deps.main([], root=repo) == 0
    assert (repo / "dvc.yaml").read_text() == (REPO / "dvc.yaml").read_text()
    assert str(init) not in (repo / "dvc.yaml").read_text()
    assert dvc_deps.main(["--check"], root=repo) == 0
    assert "dvc.yaml deps match the imports" in capsys.readouterr().out


def test_a_changed_checkpoint_at_the_same_path_stops_make_train(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """DVC sees train.init_from's value only: new files at the same path must rerun the stages
    that read them, and make train says which before dvc repro would skip them."""
    from eagle3_pipeline.config.params import load_params
    from eagle3_pipeline.harness import stage_deps

    init = tmp_path / "models/drafter"
    init.mkdir(parents=True)
    (init / "model.safetensors").write_bytes(b"v1")
    repo = _kimi_repo(tmp_path, init)
    params = load_params(repo / "params.yaml")
    for stage in ("train", "export", "evaluate", "extract"):  # as each stage starts
        stage_deps.check_path_params(stage, params.model_dump(), repo)
    assert set(yaml.safe_load((repo / stage_deps.RECORDS).read_text())) == {
        "train",
        "export",
        "evaluate",
    }
    assert dvc_deps.main([], root=repo) == 0
    (init / "model.safetensors").write_bytes(b"v2, longer")
    assert dvc_deps.main([], root=repo) == 2
    err = capsys.readouterr().err
    assert err == (
        f"error: train.init_from: the files at {init} changed since train, export, evaluate last "
        "ran, and DVC sees only the path: run `dvc repro -f -s train export evaluate`, then "
        "`make train`\n"
    )
    for stage in ("train", "export", "evaluate"):
        stage_deps.check_path_params(stage, params.model_dump(), repo)
    assert dvc_deps.main([], root=repo) == 0
    assert (repo / "dvc.yaml").read_text() == (REPO / "dvc.yaml").read_text()
