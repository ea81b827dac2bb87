"""speculators' metric dicts: tapped from its logger, written to DVCLive and as log lines.

speculators 0.9.0 logs, on the `speculators.metrics` logger with a step:

* train, every `log_freq` optimizer steps, step = global step (0-based)::

    {"train": {"loss", "loss_<k>", "full_acc_<k>", "cond_acc_<k>", "error_records"},
     "profile": {"tokens_per_s", ...}, "epoch": e, "lr": float, "global_step": s}

  k = 0..ttt_steps-1 is the draft position: `loss_k` its KL loss (times the TTT decay), `loss`
  their sum, `full_acc_k` the share of supervised tokens drafted right at k, `cond_acc_k` the
  same given positions < k right, `error_records` the dropped rows. We add `grad_norm`.
* validation, once per epoch, at the step the next epoch starts with: {"val": {the same keys
  with an "_epoch" suffix}, "epoch": e}.

The run-config record it logs first (no step) is not passed on.
"""

from __future__ import annotations

import contextlib
import csv
import json
import logging
import math
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from eagle3_pipeline.core import atomic
from eagle3_pipeline.core.progress import log
from eagle3_pipeline.training.checkpoints import resume_step

METRICS_LOGGER = "speculators.metrics"

MetricsCallback = Callable[[dict[str, Any], int], None]


def open_live(live_dir: Path) -> Any:
    """A DVCLive writer for the stage's series: no DVC experiment, no report; resumes."""
    from dvclive import Live

    return Live(
        dir=str(live_dir),
        save_dvc_exp=False,
        dvcyaml=None,
        report=None,
        resume=live_dir.is_dir(),
    )


class MetricsSink:
    """speculators' metric dicts -> DVCLive series + a plain progress line every N steps."""

    def __init__(self, live: Any, ttt_steps: int, log_every_steps: int, stage: str) -> None:
        self.live = live
        self.ttt_steps = ttt_steps
        self.log_every = log_every_steps
        self.stage = stage

    def __call__(self, record: dict[str, Any], step: int) -> None:
        self.live.step = step
        if "train" in record:
            m = record["train"]
            for key, value in m.items():
                if key != "error_records":
                    self.live.log_metric(f"train/{key}", float(value), plot=True)
            if "lr" in record:
                self.live.log_metric("train/lr", float(record["lr"]))
            if "grad_norm" in record:
                self.live.log_metric("train/grad_norm", float(record["grad_norm"]))
            tps = (record.get("profile") or {}).get("tokens_per_s")
            if tps is not None:
                self.live.log_metric("train/tokens_per_s", float(tps))
            if step % self.log_every == 0:
                accs = " ".join(
                    f"{name} {value:.3f}" for name, value in position_accs(m, self.ttt_steps)
                )
                log(
                    self.stage,
                    f"epoch {record.get('epoch')} step {step} loss {m['loss']:.4f} "
                    f"{accs} lr {record.get('lr', math.nan):.2e}",
                )
        if "val" in record:
            v = {k.removesuffix("_epoch"): float(x) for k, x in record["val"].items()}
            tau = simulated_tau(v, self.ttt_steps)
            if tau is not None:
                v["acceptance_length"] = tau
            for key, value in v.items():
                if key != "error_records":
                    self.live.log_metric(f"val/{key}", value)
            length = f" simulated acceptance length {tau:.3f}" if tau is not None else ""
            log(self.stage, f"epoch {record.get('epoch')} val loss {v['loss']:.4f}{length}")
            # Once per epoch, not per step: Live.next_step() also re-parses every series for
            # DVC Studio (even with Studio off), 30-50 ms a step here and growing with the run.
            # A kill can leave metrics.json stale; a resumed run rebuilds it (trim_live).
            self.live.make_summary()


def position_accs(train: dict[str, Any], ttt_steps: int) -> list[tuple[str, float]]:
    """(name, accuracy) per draft position: EAGLE-3's full_acc_k, else the parallel families'
    position_k_acc (P-EAGLE from depth 0, DFlash from block position 1)."""
    if any(k.startswith("full_acc_") for k in train):
        return [(f"acc{k}", train.get(f"full_acc_{k}", math.nan)) for k in range(ttt_steps)]
    found = [k for k in train if k.startswith("position_") and k.endswith("_acc")]
    found.sort(key=lambda k: int(k.split("_")[1]))
    return [(f"acc{k.split('_')[1]}", float(train[k])) for k in found]


def simulated_tau(val: dict[str, float], ttt_steps: int) -> float | None:
    """1 + sum over positions of P(all drafts up to k right), from the chained cond accuracy;
    DFlash's own expected acceptance length (`eal`); None for P-EAGLE, which reports neither."""
    if not any(k.startswith("cond_acc_") for k in val):
        return val.get("eal")
    tau, prefix = 1.0, 1.0
    for k in range(ttt_steps):
        prefix *= val.get(f"cond_acc_{k}", 0.0)
        tau += prefix
    return tau


def trim_live(live_dir: Path, save_dir: Path) -> bool:
    """Cut the DVCLive series back to the epoch the run resumes from; False: start afresh.

    Call after `discard_incomplete`. A killed run logged steps after that epoch; the rerun logs
    them again. Validation of an epoch is logged at the step the next epoch starts with, so val
    rows at that step stay. metrics.json (which a kill can leave torn: DVCLive writes it in
    place) is rebuilt from the kept rows, since DVCLive reads its step from there on resume.
    """
    step = resume_step(save_dir)
    if step is None or not live_dir.is_dir():
        shutil.rmtree(live_dir, ignore_errors=True)
        return False
    series_root = live_dir / "plots" / "metrics"
    summary: dict[str, Any] = {"step": 0}
    for tsv in sorted(series_root.glob("**/*.tsv")):
        is_val = tsv.parent.name == "val"
        with open(tsv, newline="") as fh:
            rows = list(csv.DictReader(fh, delimiter="\t"))
        kept = [r for r in rows if int(r["step"]) < step or (is_val and int(r["step"]) == step)]
        if not rows:
            continue
        columns = list(rows[0])
        atomic.write_text(
            tsv,
            "\t".join(columns)
            + "\n"
            + "".join("\t".join(r[c] for c in columns) + "\n" for r in kept),
        )
        if kept:
            node = summary
            for part in tsv.relative_to(series_root).parent.parts:
                node = node.setdefault(part, {})
            node[tsv.stem] = float(kept[-1][tsv.stem])
            summary["step"] = max(summary["step"], int(kept[-1]["step"]))
    atomic.write_json(live_dir / "metrics.json", summary)
    return True


def read_summary(live_dir: Path) -> dict[str, Any]:
    """The last value of each series, as DVCLive summarised them (metrics.json)."""
    return json.loads((live_dir / "metrics.json").read_text())


class _MetricsTap(logging.Filter):
    """Passes speculators' metric dicts (those logged with a step) to a callback, and only there."""

    def __init__(
        self, callback: MetricsCallback, grad_norm: Callable[[], float | None] | None
    ) -> None:
        super().__init__()
        self._callback = callback
        self._grad_norm = grad_norm

    def filter(self, record: logging.LogRecord) -> bool:
        step = getattr(record, "step", None)
        if isinstance(record.msg, dict) and step is not None:
            norm = self._grad_norm() if self._grad_norm is not None else None
            if "train" in record.msg and norm is not None:
                record.msg["grad_norm"] = norm
            # Not caught here: an exception in the callback stops training.
            self._callback(record.msg, step)
            # Consumed: the callback prints its own plain lines; propagated, the dict would be
            # dumped whole by speculators' console handler at every step.
            return False
        return True


@contextlib.contextmanager
def metrics_tap(
    on_metrics: MetricsCallback | None, grad_norm: Callable[[], float | None] | None = None
) -> Iterator[None]:
    """Route speculators' metric dicts to `on_metrics` (with `grad_norm()` on train records).

    A logger filter, not a handler: speculators' `main()` reconfigures this logger and drops its
    handlers, and on the root logger its console handler turns the dict into a string before a
    later handler sees it. Logger filters survive and run first. None: nothing is tapped.
    """
    if on_metrics is None:
        yield
        return
    logger = logging.getLogger(METRICS_LOGGER)
    tap = _MetricsTap(on_metrics, grad_norm)
    logger.addFilter(tap)
    try:
        yield
    finally:
        logger.removeFilter(tap)
