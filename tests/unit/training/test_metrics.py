"""Metric dicts -> DVCLive series and log lines; series cut back to the resumed epoch."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from eagle3_pipeline.training import checkpoints, metrics


class _Live:
    def __init__(self) -> None:
        self.step = 0
        self.logged: list[tuple[int, str, float]] = []
        self.summaries = 0

    def log_metric(self, name: str, value: float, plot: bool = True) -> None:
        self.logged.append((self.step, name, value))

    def make_summary(self) -> None:
        self.summaries += 1


def test_simulated_tau_chains_conditional_accuracy() -> None:
    assert metrics.simulated_tau({"cond_acc_0": 0.5, "cond_acc_1": 0.5}, 2) == 1.75
    assert metrics.simulated_tau({"cond_acc_0": 0.0}, 3) == 1.0


def test_parallel_families_report_their_own_positions() -> None:
    """P-EAGLE and DFlash log position_k_acc (no chained cond_acc): the line shows those, the
    acceptance length is DFlash's own `eal` and none for P-EAGLE (never a made-up 1.0)."""
    peagle = {"loss": 1.0, "position_1_acc": 0.2, "position_0_acc": 0.5, "full_acc": 0.3}
    assert metrics.position_accs(peagle, 3) == [("acc0", 0.5), ("acc1", 0.2)]
    assert metrics.position_accs({"full_acc_0": 0.4}, 2)[0] == ("acc0", 0.4)
    assert metrics.simulated_tau({"position_0_acc": 0.5}, 3) is None
    assert metrics.simulated_tau({"eal": 1.4, "position_1_acc": 0.5}, 3) == 1.4


def test_sink_logs_series_and_lines(capsys: pytest.CaptureFixture[str]) -> None:
    live = _Live()
    sink = metrics.MetricsSink(live, ttt_steps=1, log_every_steps=2, stage="train")
    train = {"loss": 1.0, "full_acc_0": 0.5, "error_records": 0}
    sink({"train": train, "lr": 0.1, "grad_norm": 2.0, "epoch": 0}, 0)
    sink({"train": train, "lr": 0.1, "epoch": 0}, 1)
    sink({"val": {"loss_epoch": 0.9, "cond_acc_0_epoch": 0.5}, "epoch": 0}, 2)
    names = {name for _, name, _ in live.logged}
    assert {"train/loss", "train/lr", "train/grad_norm", "val/acceptance_length"} <= names
    assert "train/error_records" not in names
    assert (2, "val/acceptance_length", 1.5) in live.logged and live.summaries == 1
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and lines[0].startswith("[train] epoch 0 step 0 loss 1.0000")


def test_tap_consumes_stepped_dicts_only() -> None:
    got: list[tuple[int, dict]] = []
    logger = logging.getLogger(metrics.METRICS_LOGGER)
    level, filters = logger.level, list(logger.filters)
    logger.setLevel(logging.INFO)
    try:
        with metrics.metrics_tap(lambda m, s: got.append((s, m)), lambda: 0.5):
            logger.info({"train": {"loss": 1.0}}, extra={"step": 3})
            logger.info({"val": {"loss_epoch": 1.0}}, extra={"step": 4})
            logger.debug("a plain line")  # no step: not a metric record
        logger.info({"train": {}}, extra={"step": 5})  # after the block: not tapped
    finally:
        logger.setLevel(level)
    assert got == [
        (3, {"train": {"loss": 1.0}, "grad_norm": 0.5}),
        (4, {"val": {"loss_epoch": 1.0}}),
    ]
    assert logger.filters == filters  # the tap is gone


def _series(live: Path, name: str, rows: list[tuple[int, float]]) -> None:
    path = live / "plots" / "metrics" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    key = path.stem
    path.write_text(f"timestamp\tstep\t{key}\n" + "".join(f"0\t{s}\t{v}\n" for s, v in rows))


def test_trim_live_cuts_back_to_the_resumed_epoch(tmp_path: Path) -> None:
    live, save = tmp_path / "live", tmp_path / "ckpt"
    _series(live, "train/loss.tsv", [(0, 3.0), (1, 2.0), (2, 1.5), (3, 1.0)])
    _series(live, "val/loss.tsv", [(2, 2.5)])
    assert not metrics.trim_live(live, save)  # nothing to resume: start afresh
    assert not live.exists()

    _series(live, "train/loss.tsv", [(0, 3.0), (1, 2.0), (2, 1.5), (3, 1.0)])
    _series(live, "val/loss.tsv", [(2, 2.5)])
    (save / "0").mkdir(parents=True)
    marker: dict[str, Any] = {"epoch": 0, "global_step": 2}
    (save / "0" / checkpoints.COMPLETE_MARKER).write_text(json.dumps(marker))
    assert metrics.trim_live(live, save)
    summary = metrics.read_summary(live)
    assert summary == {"step": 2, "train": {"loss": 2.0}, "val": {"loss": 2.5}}
    lines = (live / "plots/metrics/train/loss.tsv").read_text().splitlines()
    assert [line.split("\t")[1] for line in lines[1:]] == ["0", "1"]
