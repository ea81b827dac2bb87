"""A stage's code is part of what it depends on; the files its path params name are recorded
where no dep holds them (the record and its check: tests/unit/test_dvc_yaml.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

from eagle3_pipeline.config.params import load_params
from eagle3_pipeline.harness import stage_deps

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "scripts"))
import dvc_deps  # noqa: E402


def test_the_default_corpus_is_covered_by_data_corpus() -> None:
    params = load_params(REPO / "params.yaml")
    assert stage_deps.path_params("verifier", params.model_dump()) == {
        "verifier.tiny.corpus": "data/corpus/verifier_corpus.jsonl"
    }
    stage_deps.check_path_params("verifier", params.model_dump(), REPO)
    text = (REPO / "dvc.yaml").read_text()
    assert dvc_deps.rewrite(text, list(yaml.safe_load(text)["stages"])) == text
