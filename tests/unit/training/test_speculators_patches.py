"""The version pin and the scoped patches, each seen in a real speculators 0.9.0 run."""

from __future__ import annotations

import importlib.metadata
import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from train_workspace import train_tiny, verifier_head_rows

from eagle3_pipeline.training import speculators_patches as sp


def test_check_version_accepts_pinned() -> None:
    sp.check_version()


def test_check_version_rejects_other(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.10.0")
    with pytest.raises(RuntimeError, match=r"speculators 0\.10\.0 .* 0\.9\.0 only") as refused:
        sp.check_version()
    message = str(refused.value)  # one line: why, where the patches are listed, how to try 0.10.0
    assert "\n" not in message
    for named in ("docs/training.md", "constraints/shared.txt", "PINNED_SPECULATORS"):
        assert named in message
    with pytest.raises(RuntimeError):
        sp.apply_cpu_shims()


def test_fused_loss_kernels_get_their_own_config_lists(monkeypatch: pytest.MonkeyPatch) -> None:
    """Upstream, both Triton kernels share one autotune list, which Dynamo refuses on a GPU."""
    fused = pytest.importorskip("speculators.losses.fused")
    fwd, bwd = fused.loss_forward_kernel, fused.loss_backward_kernel
    monkeypatch.setattr(bwd, "configs", fwd.configs)  # as speculators 0.9.0 builds them
    tiles = [(c.kwargs, c.num_warps) for c in fwd.configs]
    sp.separate_fused_loss_configs()
    assert fwd.configs is not bwd.configs
    assert [(c.kwargs, c.num_warps) for c in bwd.configs] == tiles
    assert [(c.kwargs, c.num_warps) for c in fwd.configs] == tiles
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bwd, "configs", fwd.configs)
    sp.apply_shims()  # on a CUDA machine apply_shims is this fix
    assert fwd.configs is not bwd.configs


@pytest.mark.slow
def test_train_lm_head(inputs: dict[str, Any], tmp_path: Path) -> None:
    from speculators.models.eagle3.core import Eagle3DraftModel

    original = Eagle3DraftModel.load_verifier_weights
    train_tiny(inputs, tmp_path, train_lm_head=True)
    weights = load_file(tmp_path / "ckpt" / "0" / "model.safetensors")
    assert not torch.equal(weights["lm_head.weight"], verifier_head_rows(inputs))
    assert Eagle3DraftModel.load_verifier_weights is original


@pytest.mark.slow
def test_noise_changes_training_and_stays_reproducible(
    inputs: dict[str, Any], tmp_path: Path
) -> None:
    def weights(name: str, noise: float) -> dict[str, torch.Tensor]:
        run = tmp_path / name
        run.mkdir()
        train_tiny(inputs, run, noise_std=noise)
        return load_file(run / "ckpt" / "0" / "model.safetensors")

    clean, noisy, noisy_again = weights("a", 0.0), weights("b", 0.5), weights("c", 0.5)
    assert not torch.equal(clean["fc.weight"], noisy["fc.weight"])
    assert all(torch.equal(noisy[k], noisy_again[k]) for k in noisy)
    from speculators.models.eagle3.core import Eagle3DraftModel

    assert Eagle3DraftModel.forward.__name__ == "forward"  # the patch was undone


@pytest.mark.slow
def test_grad_accumulation_steps_every_nth_batch(inputs: dict[str, Any], tmp_path: Path) -> None:
    """N=3: one optimizer and scheduler step per 3 micro-batches (and the epoch's last one)."""
    counts = {}
    for n in (1, 3):
        run = tmp_path / f"acc{n}"
        run.mkdir()
        metrics = train_tiny(inputs, run, grad_accumulation=n, max_tokens_per_batch=128)
        train = [m for _, m in metrics if "train" in m]
        stepped = [i for i, m in enumerate(train) if "grad_norm" in m]
        assert all(math.isfinite(train[i]["grad_norm"]) for i in stepped)
        assert stepped == [i for i in range(len(train)) if (i + 1) % n == 0 or i + 1 == len(train)]
        optimizer = torch.load(run / "ckpt" / "0" / "optimizer_state_dict.pt")
        scheduler = torch.load(run / "ckpt" / "0" / "scheduler_state_dict.pt")
        steps = {int(s["step"]) for s in optimizer["state"].values()}
        counts[n] = (len(train), steps, scheduler["last_epoch"])
        # lr is logged per micro-batch: constant within a group of n
        lrs = [m["lr"] for m in train]
        assert all(lrs[i] == lrs[i - i % n] for i in range(len(lrs)))
    batches = counts[1][0]
    assert batches >= 4 and counts[3][0] == batches
    assert counts[1][1:] == ({batches}, batches)
    groups = math.ceil(batches / 3)
    assert counts[3][1:] == ({groups}, groups)


def test_online_api_key_is_what_speculators_online_client_sends() -> None:
    import inspect

    import openai
    from speculators.train import data

    from eagle3_pipeline.training.speculators_patches import online_api_key

    # speculators' online dataset builds its client through its module's `openai` name
    assert 'openai.OpenAI(\n            base_url=self.vllm_endpoint, api_key="EMPTY"' in (
        inspect.getsource(data)
    )
    with online_api_key("run-key"):
        client = data.openai.OpenAI(base_url="http://127.0.0.1:9/v1", api_key="EMPTY")
        assert client.api_key == "run-key"
        assert data.openai.AuthenticationError is openai.AuthenticationError  # the rest as is
    assert data.openai is openai  # restored
    with online_api_key(None):
        assert data.openai is openai  # no key: nothing patched


@pytest.mark.slow
def test_thread_limits_stay_inside_the_run(
    inputs: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """speculators sets OMP/MKL/OPENBLAS_NUM_THREADS=1 in the process that builds its loaders;
    after an in-process run every process started later must still get this one's threads."""
    for key in sp.THREAD_VARS:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("MKL_NUM_THREADS", "2")
    train_tiny(inputs, tmp_path)
    assert "OMP_NUM_THREADS" not in os.environ and "OPENBLAS_NUM_THREADS" not in os.environ
    assert os.environ["MKL_NUM_THREADS"] == "2"
