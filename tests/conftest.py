"""Shared fixtures; tests/helpers/ (builders and workspaces the tests share) is importable."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests/helpers"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("DVC_NO_ANALYTICS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


from verifiers import build_tiny_dsv3_verifier, build_tiny_verifier  # noqa: E402


@pytest.fixture(scope="session")
def tiny_verifier_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shared seeded verifier (5 training steps), servable by vLLM on CPU."""
    return build_tiny_verifier(tmp_path_factory.mktemp("verifier") / "verifier")


@pytest.fixture(scope="session")
def tiny_dsv3_verifier_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny-dsv3 verifier (Kimi-K2.5's nesting around a DeepSeek-V3 MLA + MoE text model),
    built once for its unit tests and its vLLM test."""
    return build_tiny_dsv3_verifier(tmp_path_factory.mktemp("dsv3") / "verifier")
