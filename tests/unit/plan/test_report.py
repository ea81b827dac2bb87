"""report.render: the checkpoint disk need as the team reads it."""

from __future__ import annotations

import pytest
from plan_cases import AQ_MEDAI, KIMI, PROFILE

from eagle3_pipeline.config.params import load_params
from eagle3_pipeline.plan import plan, report


@pytest.mark.parametrize(("keep_last", "kept"), [(2, 3), (None, 5), (9, 5)])
def test_checkpoint_disk_need_follows_keep_last(keep_last: int | None, kept: int) -> None:
    params = load_params(PROFILE)
    params.train.keep_last = keep_last  # 5 epochs in the profile
    p = plan.make_plan(params, PROFILE, KIMI, AQ_MEDAI, tokens=1_000_000)
    assert p.checkpoints_kept == kept
    per_epoch = p.checkpoint_weights_bytes + p.checkpoint_optimizer_bytes
    assert f"kept {kept} (train.keep_last + the best): {report._size(per_epoch * kept)}" in (
        report.render(p)
    )
