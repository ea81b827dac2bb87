"""The split hash: val by ratio, training fractions nested and spread as asked."""

from __future__ import annotations

from eagle3_pipeline.conversations import split
from eagle3_pipeline.stages.prepare import is_val

IDS = [f"s{i:05d}" for i in range(4000)]


def test_val_is_prepares_split() -> None:
    assert [split.is_val(i, 0.1) for i in IDS] == [is_val(i, 0.1) for i in IDS]


def test_fractions_are_nested_and_hold_their_share_of_the_training_rows() -> None:
    train = [i for i in IDS if not split.is_val(i, 0.1)]
    inside = {f: {i for i in train if split.in_fraction(i, f, 0.1)} for f in (0.125, 0.25, 0.5)}
    assert inside[0.125] <= inside[0.25] <= inside[0.5]
    for f, rows in inside.items():
        assert abs(len(rows) / len(train) - f) < 0.03
    assert all(split.in_fraction(i, 1.0, 0.1) for i in train)
