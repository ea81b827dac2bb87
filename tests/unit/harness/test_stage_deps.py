"""A stage's code is part of what it depends on; the files its path params name are recorded
where no dep holds them (the record and its check: tests/unit/test_dvc_yaml.py)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import yaml

from eagle3_pipeline.config.params import load_params
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


def test_the_default_corpus_is_covered_by_data_corpus() -> None:
    params = load_params(REPO / "params.yaml")
    assert stage_deps.path_params("verifier", params) == {
        "verifier.tiny.corpus": "data/corpus/verifier_corpus.jsonl"
    }
    stage_deps.check_path_params("verifier", params, REPO)
    text = (REPO / "dvc.yaml").read_text()
    assert dvc_deps.rewrite(text, list(yaml.safe_load(text)["stages"])) == text
