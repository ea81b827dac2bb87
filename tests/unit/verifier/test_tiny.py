"""verifier/tiny.lr_schedule: every step count trains, 300 steps keep their one-cycle schedule."""

from __future__ import annotations

import pytest
import torch

from eagle3_pipeline.verifier.tiny import ONE_CYCLE_MIN_STEPS, lr_schedule


def _lrs(steps: int, max_lr: float = 3e-3) -> list[float]:
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=max_lr)
    sched = lr_schedule(opt, max_lr, steps)
    seen = []
    for _ in range(steps):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return seen


@pytest.mark.parametrize("steps", [1, 2, 3, 19, 20, 21, 39, 40, 60])
def test_every_step_count_steps_through(steps: int) -> None:
    lrs = _lrs(steps)
    assert len(lrs) == steps and all(0.0 <= x <= 3e-3 + 1e-12 for x in lrs)
    assert max(lrs) == pytest.approx(3e-3)


def test_short_runs_decay_linearly_from_the_peak() -> None:
    assert _lrs(4) == pytest.approx([3e-3, 2.25e-3, 1.5e-3, 0.75e-3])


def test_long_runs_keep_one_cycle_with_5_percent_warm_up() -> None:
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=3e-3)
    assert isinstance(lr_schedule(opt, 3e-3, 300), torch.optim.lr_scheduler.OneCycleLR)
    lrs = _lrs(300)
    assert lrs.index(max(lrs)) == 14  # warm-up ends at 5% of 300 steps, as before
    assert ONE_CYCLE_MIN_STEPS * 0.05 >= 2
