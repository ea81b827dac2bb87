"""Shared fixtures: a tiny random Llama verifier with the project's tokenizer and chat template."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("DVC_NO_ANALYTICS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_verifier_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A seeded verifier built by the real verifier stage (few training steps), reused by tests."""
    from eagle3_pipeline.params import Params
    from eagle3_pipeline.stages import verifier as stage

    out = tmp_path_factory.mktemp("verifier") / "verifier"
    params = Params.model_validate(
        {
            "verifier": {
                "tiny": {
                    "train_steps": 5,
                    "corpus": str(REPO / "data/corpus/verifier_corpus.jsonl"),
                    "vocab_size": 1024,
                    "hidden_size": 64,
                    "intermediate_size": 128,
                    # head_dim 32: vLLM's CPU attention rejects head_dim 16
                    "num_attention_heads": 2,
                    "num_key_value_heads": 1,
                }
            },
            "vocab": {"draft_vocab_size": 256},
        }
    )
    out.mkdir()
    stage.build_tiny(params, out)
    return out


@pytest.fixture
def repo_copy(tmp_path: Path) -> Path:
    """The project's tracked files copied into a fresh git+dvc repo (no outputs, no .venv)."""
    import subprocess

    dst = tmp_path / "repo"
    files = subprocess.run(
        ["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    for f in files:
        target = dst / f
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / f, target)
    return dst
