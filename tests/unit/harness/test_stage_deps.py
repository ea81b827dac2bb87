"""A stage's code and the files its path params name are part of what it depends on."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import yaml

from eagle3_pipeline.config.params import load_params
from eagle3_pipeline.core.errors import ParamsError
from eagle3_pipeline.harness import stage_deps

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "scripts"))
import dvc_deps  # noqa: E402


def test_code_hash_follows_every_module_the_stage_imports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pkg = tmp_path / "eagle3_pipeline"
    shutil.copytree(stage_deps.PKG, pkg, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(stage_deps, "PKG", pkg)
    before = stage_deps.code_sha256("generate")
    assert stage_deps.code_sha256("generate") == before
    chat = pkg / "serving/chat.py"  # imported by generate through a shared module
    chat.write_text(chat.read_text() + "\n# a fix\n")
    assert stage_deps.code_sha256("generate") != before
    assert stage_deps.code_sha256("vocab") == stage_deps.code_sha256("vocab")


def _repo(tmp_path: Path, **train: object) -> Path:
    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    raw["train"] |= train
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw))
    shutil.copy(REPO / "dvc.yaml", tmp_path / "dvc.yaml")
    return tmp_path


def test_an_init_checkpoint_outside_the_deps_is_refused_until_dvc_deps_adds_it(
    tmp_path: Path,
) -> None:
    init = tmp_path / "published-drafter"
    (tmp_path / "repo").mkdir()
    repo = _repo(tmp_path / "repo", init_from=str(init))
    params = load_params(repo / "params.yaml")
    for stage in ("train", "export", "evaluate"):
        with pytest.raises(ParamsError, match=rf"stage {stage} does not list train.init_from"):
            stage_deps.check_path_params(stage, params, repo)
    stage_deps.check_path_params("extract", params, repo)  # extract never reads it
    text = (repo / "dvc.yaml").read_text()
    new = dvc_deps.rewrite(text, list(yaml.safe_load(text)["stages"]), params)
    (repo / "dvc.yaml").write_text(new)
    for stage in ("train", "export", "evaluate"):
        stage_deps.check_path_params(stage, params, repo)
        assert str(init) in stage_deps.stage_dep_paths(new, stage)
    assert str(init) not in stage_deps.stage_dep_paths(new, "extract")
    # DVC reads the new deps: each names the checkpoint once, marked as coming from a param.
    train_deps = yaml.safe_load(new)["stages"]["train"]["deps"]
    assert train_deps.count(str(init)) == 1 and f"{init}  # param: train.init_from" in new
    # Back to no init checkpoint: the line goes again.
    params_none = load_params(_repo(repo, init_from=None) / "params.yaml")
    again = dvc_deps.rewrite(new, list(yaml.safe_load(new)["stages"]), params_none)
    assert again == text


def test_the_default_corpus_is_covered_by_data_corpus() -> None:
    params = load_params(REPO / "params.yaml")
    assert stage_deps.path_params("verifier", params) == {
        "verifier.tiny.corpus": "data/corpus/verifier_corpus.jsonl"
    }
    stage_deps.check_path_params("verifier", params, REPO)
    text = (REPO / "dvc.yaml").read_text()
    assert dvc_deps.rewrite(text, list(yaml.safe_load(text)["stages"]), params) == text
