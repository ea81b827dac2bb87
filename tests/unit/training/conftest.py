"""The tiny run inputs (verifier, samples, vocab mapping) the training unit tests share."""

from __future__ import annotations

from typing import Any

import pytest
from train_workspace import build_run_inputs


@pytest.fixture(scope="session")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return build_run_inputs(tmp_path_factory.mktemp("inputs"))
