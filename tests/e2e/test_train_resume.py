"""Exact resume of the `train` stage: SIGKILL mid-epoch, rerun, same weights bit for bit.

Three subprocess runs of `eagle3 train` on a tiny synthetic workspace (noise_std > 0, so the
RNG state matters): one uninterrupted; one killed with SIGKILL during epoch 2 (index 1) after
epoch 1's completion marker appeared, then given an incomplete epoch directory as a kill during
a save would leave, then rerun. Final weights (full precision and the bf16 output), the per-step
loss curve in DVCLive and the kept checkpoints must agree.
"""

from __future__ import annotations

import csv
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from train_workspace import build_workspace, checkpoints, kill_during_epoch_2, run_stage

from eagle3_pipeline.training import checkpoints as ck

pytestmark = pytest.mark.slow
TRAIN = {"epochs": 2, "keep_last": 1}
LAST = 1  # the final epoch's directory


def _series(root: Path, name: str) -> list[tuple[str, str]]:
    path = root / "metrics/train/plots/metrics" / name
    with open(path) as fh:
        rows = list(csv.DictReader(fh, delimiter="\t"))
    key = Path(name).stem
    return [(r["step"], r[key]) for r in rows]


def test_sigkill_mid_epoch_then_rerun_equals_uninterrupted(
    tiny_verifier_dir: Path, tmp_path: Path
) -> None:
    whole = build_workspace(tmp_path / "whole", tiny_verifier_dir, n_train=16, train=TRAIN)
    run_stage(whole)

    killed = build_workspace(tmp_path / "killed", tiny_verifier_dir, n_train=16, train=TRAIN)
    kill_during_epoch_2(killed)
    # What a kill while epoch 2 was being saved leaves: files, no marker.
    half = checkpoints(killed) / str(LAST)
    shutil.copytree(checkpoints(killed) / "0", half)
    (half / ck.COMPLETE_MARKER).unlink()
    out = run_stage(killed)
    assert "resuming after epoch 0 (discarded incomplete: 1" in out

    a = torch.load(checkpoints(whole) / str(LAST) / ck.EXACT_STATE, weights_only=False)["model"]
    b = torch.load(checkpoints(killed) / str(LAST) / ck.EXACT_STATE, weights_only=False)["model"]
    assert a.keys() == b.keys()
    assert [k for k in a if not torch.equal(a[k], b[k])] == []
    assert a["fc.weight"].dtype == torch.float32
    out_a = load_file(whole / "models/trained/final/model.safetensors")
    out_b = load_file(killed / "models/trained/final/model.safetensors")
    assert all(torch.equal(out_a[k], out_b[k]) for k in out_a)

    # The rerun replayed epoch 2 exactly, and the killed run's partial steps were cut.
    for name in ("train/loss.tsv", "train/lr.tsv", "val/loss.tsv"):
        assert _series(whole, name) == _series(killed, name), name
    steps = [int(s) for s, _ in _series(killed, "train/loss.tsv")]
    assert steps == list(range(len(steps)))

    # keep_last 1: the newest complete epoch, plus the best one.
    for root in (whole, killed):
        best = ck.best_checkpoint(checkpoints(root))
        assert ck.complete_epochs(checkpoints(root)) == sorted({LAST, int(best.name)})
