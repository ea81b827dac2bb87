"""The report's summary series: every drafter eval.json holds, durations, store size."""

from __future__ import annotations

import pytest
from report_fixtures import eval_doc

from eagle3_pipeline.report import series


def test_acceptance_has_every_drafter_offline_in_order_then_online() -> None:
    rows = series.acceptance(eval_doc())
    order = [(r["drafter"], r["mode"]) for r in rows if r["position"] == 1]
    assert order == [
        ("untrained", "offline"),
        ("init", "offline"),
        ("trained", "offline"),
        ("trained", "online"),
    ]
    trained = [
        r["acceptance"] for r in rows if r["drafter"] == "trained" and r["mode"] == "offline"
    ]
    assert trained == [0.8, 0.65, 0.55]
    assert {r["position"] for r in rows} == {1, 2, 3}


def test_acceptance_without_init_and_with_online_per_drafter() -> None:
    ev = eval_doc()
    del ev["offline"]["init"]
    ev["online"] = {"trained": ev["online"], "init": {"acceptance_per_position": [0.3, 0.2, 0.1]}}
    rows = series.acceptance(ev)
    online = [(r["drafter"], r["acceptance"]) for r in rows if r["mode"] == "online"]
    assert online[:3] == [("init", 0.3), ("init", 0.2), ("init", 0.1)]
    assert [d for d, _ in online[3:]] == ["trained"] * 3
    assert not any(r["drafter"] == "init" and r["mode"] == "offline" for r in rows)


def test_served_acceptance_per_held_out_set_val_first() -> None:
    assert series.served(eval_doc()) == [
        {"label": "val", "value": pytest.approx(2.8)},
        {"label": "humaneval", "value": pytest.approx(2.0)},
    ]
    assert series.served({"offline": {}}) == []


def test_throughput_durations_and_store() -> None:
    assert series.throughput(eval_doc()) == [
        {"label": "without drafter", "value": 150.0},
        {"label": "with drafter", "value": 200.0},
    ]
    assert series.throughput({"offline": {}}) == []
    recs = {
        "train": {"recorded_at": "2026-01-01T00:02:00+00:00", "duration_s": 5},
        "prepare": {"recorded_at": "2026-01-01T00:01:00+00:00"},  # before duration_s existed
    }
    assert [(r["label"], r["value"]) for r in series.durations(recs)] == [
        ("prepare", None),
        ("train", 5.0),
    ]
    manifest = {
        "bytes_per_token": 1024,
        "dtype": "fp8",
        "layer_ids": [1, 2],
        "num_tokens": 7,
        "samples": {"a": {"bytes": 1_500_000}, "b": {"bytes": 500_000}},
    }
    (size,) = series.store_size(manifest)
    assert size["value"] == 2.0 and size["num_tokens"] == 7 and size["num_samples"] == 2
    assert series.bytes_per_token(manifest) == [
        {"label": "fp8", "value": 1024.0, "layers": 2, "hidden_size": None}
    ]
    derived = series.derive(None, {}, None)
    assert set(derived) == set(series.NAMES) and not any(derived.values())
