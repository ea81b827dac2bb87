"""Every rank reads its own samples: speculators' sampler rank must follow the global RANK.

Its bug #427/#619 took LOCAL_RANK, so on 2 nodes x 1 process both ranks were sampler rank 0 and
read the same samples. `check_sampler_rank` refuses that where the loaders are built.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist
from speculators.train import cli
from speculators.train import distributed as sd

from eagle3_pipeline.training import speculators_patches as sp


def _torchrun_env(monkeypatch: pytest.MonkeyPatch, rank: int, local_rank: int, world: int) -> None:
    for key, value in {"RANK": rank, "LOCAL_RANK": local_rank, "WORLD_SIZE": world}.items():
        monkeypatch.setenv(key, str(value))


def _topology(monkeypatch: pytest.MonkeyPatch, dp_rank: int, dp_size: int, sp_size: int = 1):
    monkeypatch.setattr(sd, "_dp_rank", dp_rank)
    monkeypatch.setattr(sd, "_dp_size", dp_size)
    monkeypatch.setattr(sd, "_sp_size", sp_size)


def test_second_node_with_local_rank_as_sampler_rank_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _torchrun_env(monkeypatch, rank=1, local_rank=0, world=2)  # node 2 of 2, one process each
    _topology(monkeypatch, dp_rank=0, dp_size=2)  # the LOCAL_RANK bug
    with pytest.raises(RuntimeError, match="rank 0 of 2, but this process is RANK 1"):
        sp.check_sampler_rank()
    _topology(monkeypatch, dp_rank=1, dp_size=2)
    sp.check_sampler_rank()


def test_sequence_parallel_groups_share_a_sampler_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    _torchrun_env(monkeypatch, rank=3, local_rank=1, world=4)
    _topology(monkeypatch, dp_rank=1, dp_size=2, sp_size=2)
    sp.check_sampler_rank()
    _topology(monkeypatch, dp_rank=3, dp_size=4, sp_size=2)
    with pytest.raises(RuntimeError):
        sp.check_sampler_rank()


def test_outside_torchrun_nothing_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    _topology(monkeypatch, dp_rank=5, dp_size=1)
    sp.check_sampler_rank()


def test_guard_runs_where_speculators_builds_the_loaders(monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[int] = []
    monkeypatch.setattr(cli, "create_train_val_loaders", lambda **kw: built.append(1))
    _torchrun_env(monkeypatch, rank=1, local_rank=0, world=2)
    _topology(monkeypatch, dp_rank=0, dp_size=2)
    with sp.sampler_rank_guard(), pytest.raises(RuntimeError):
        cli.create_train_val_loaders(data_path="x")
    assert built == []  # refused before any loader was built
    cli.create_train_val_loaders(data_path="x")  # the guard is gone after the block
    assert built == [1]


def test_our_gloo_setup_takes_the_global_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU shim that replaces speculators' setup: rank 1 of 2 on its node's LOCAL_RANK 0."""
    _torchrun_env(monkeypatch, rank=1, local_rank=0, world=2)
    for name in ("_local_rank", "_rank", "_world_size", "_is_distributed", "_sp_group",
                 "_dp_group", "_sp_rank", "_dp_rank", "_dp_size", "_sp_size"):  # fmt: skip
        monkeypatch.setattr(sd, name, getattr(sd, name))
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **kw: None)
    monkeypatch.setattr(dist, "get_rank", lambda *a: 1)
    monkeypatch.setattr(dist, "get_world_size", lambda *a: 2)
    monkeypatch.setattr(dist, "new_group", lambda ranks: tuple(ranks))
    sp._setup_distributed_gloo()
    assert (sd.get_dp_rank(), sd.get_dp_size()) == (1, 2)
    sp.check_sampler_rank()
