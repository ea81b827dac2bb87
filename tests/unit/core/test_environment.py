"""core.environment.restored: variables set inside, every one put back as it was after (unset
ones unset), also when the body raises."""

from __future__ import annotations

import os

import pytest

from eagle3_pipeline.core import environment


def test_set_inside_and_restored_after_even_on_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EAGLE3_T_KEPT", "before")
    monkeypatch.delenv("EAGLE3_T_NEW", raising=False)
    monkeypatch.delenv("EAGLE3_T_CHANGED_INSIDE", raising=False)
    with (
        pytest.raises(RuntimeError),
        environment.restored(
            ["EAGLE3_T_CHANGED_INSIDE"], set_to={"EAGLE3_T_KEPT": "inside", "EAGLE3_T_NEW": "1"}
        ),
    ):
        assert os.environ["EAGLE3_T_KEPT"] == "inside" and os.environ["EAGLE3_T_NEW"] == "1"
        os.environ["EAGLE3_T_CHANGED_INSIDE"] = "x"  # as speculators' loader builder does
        raise RuntimeError
    assert os.environ["EAGLE3_T_KEPT"] == "before"
    assert "EAGLE3_T_NEW" not in os.environ and "EAGLE3_T_CHANGED_INSIDE" not in os.environ
