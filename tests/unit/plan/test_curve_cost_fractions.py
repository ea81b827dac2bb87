"""What curve.fractions adds to a plan: each fraction's training (sum(F) x train's, in the
hours) and checkpoints (in the disk), in store mode; in online mode, the store they would need.
The Kimi profiles carry fractions, so their plans show it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from plan_cases import AQ_MEDAI, KIMI, PROFILE, REPO, kimi_plan, profile

from eagle3_pipeline.config.params import load_params
from eagle3_pipeline.core.errors import ParamsError
from eagle3_pipeline.plan import plan, report

KIMI_PROFILES = ["kimi-k2.5.yaml", "kimi-k2.5-4nodes.yaml", "kimi-k2.5-families.yaml"]
# 8 ranks at 49,000 tokens/s (nodes.RATES["gpu"]), 5 epochs of 149,760,000 train tokens.
KIMI_TRAIN_S = 5 * 149_760_000 / (8 * 49_000)


@pytest.mark.parametrize("name", KIMI_PROFILES)
def test_the_kimi_profiles_train_the_curve(name: str) -> None:
    assert load_params(REPO / "profiles" / name).curve.fractions == [0.125, 0.25, 0.5]


def test_kimi_fractions_add_their_training_and_checkpoints_to_the_totals() -> None:
    p = kimi_plan()
    f, t = p.fractions, p.summary
    assert f is not None and t is not None and t.seconds is not None
    assert (f.fractions, f.share) == ([0.125, 0.25, 0.5], 0.875)
    assert t.seconds["train"] == pytest.approx(KIMI_TRAIN_S)
    assert f.train_s == t.seconds["curve_train"] == pytest.approx(0.875 * KIMI_TRAIN_S)
    # Each fraction: 3 epoch checkpoints kept (weights + AdamW), best and final weights.
    w, o = p.checkpoint_weights_bytes, p.checkpoint_optimizer_bytes
    assert f.checkpoint_bytes == t.curve_bytes == 3 * (3 * (w + o) + 2 * w)
    assert round(f.checkpoint_bytes / 1e9, 2) == 156.72
    assert t.total_bytes == t.weights.bytes + t.store_bytes + t.checkpoint_bytes + t.curve_bytes
    # Online: the store the fractions read, beyond the 200 val samples online mode keeps.
    own = p.scales[0]
    extra = own.store.disk_tokens - own.online.disk_tokens
    assert f.store_bytes == extra * 4 * 7168 * 2  # 4 layers x hidden 7,168, bf16
    assert f.store_extract_s == pytest.approx(extra / 3_000)


def test_without_fractions_the_totals_are_the_runs_own(tmp_path: Path) -> None:
    def no_curve(raw: dict) -> None:
        raw["curve"]["fractions"] = []

    path = profile(tmp_path, no_curve)
    bare = plan.make_plan(load_params(path), path, KIMI, AQ_MEDAI)
    full = kimi_plan()
    assert bare.fractions is None and bare.summary is not None and full.summary is not None
    assert "curve_train" not in bare.summary.seconds and bare.summary.curve_bytes == 0
    assert sum(full.summary.seconds.values()) - sum(bare.summary.seconds.values()) == (
        pytest.approx(0.875 * KIMI_TRAIN_S)
    )
    assert full.summary.total_bytes - bare.summary.total_bytes == full.summary.curve_bytes
    assert not re.search(r"^fractions ", report.render(bare), re.M)


def test_kimi_plan_shows_the_fractions_in_both_modes_and_in_the_totals(capsys) -> None:
    from eagle3_pipeline.cli import main

    assert main(["plan", "--params", str(PROFILE)]) == 0
    out = capsys.readouterr().out
    assert (
        "fractions   curve.fractions 0.125, 0.25, 0.5: train's drafter trained again on each "
        "nested fraction of the same rows, 0.875 x train's training tokens"
    ) in out
    assert re.search(
        r"^            store \(\*\): \+ 28 min of training \(curve_train, in the hours below\); "
        r"\+ 156\.72 GB of checkpoints .*; no hidden states",
        out,
        re.M,
    )
    assert re.search(
        r"^            online: refused at load: .* the store besides: \+ 9\.35 TB \(bf16\) and "
        r"15\.1 h of extract$",
        out,
        re.M,
    )
    assert "+ checkpoints 42.78 GB (3 kept) + curve fractions 156.72 GB" in out
    assert re.search(r"^hours .* \+ train 32 min \+ curve_train 28 min = ~58\.5 h", out, re.M)


def test_the_cluster_trains_the_fractions_on_its_training_nodes(monkeypatch) -> None:
    monkeypatch.chdir(REPO)
    rel = Path("profiles/kimi-k2.5-4nodes.yaml")
    p = plan.make_plan(load_params(rel), rel, KIMI, AQ_MEDAI, prompts=1000)
    assert p.cluster is not None and p.summary is not None
    times = p.cluster.stage_seconds
    assert times["curve_train"] == pytest.approx(0.875 * times["train"])
    assert p.summary.seconds["curve_train"] == pytest.approx(times["curve_train"])


def test_online_mode_with_fractions_is_refused_at_load(tmp_path: Path) -> None:
    """What the online line says: the pair is refused before any plan."""

    def online(raw: dict) -> None:
        raw["train"]["hidden_states"] = "online"
        raw["train"]["num_workers"] = 0  # online mode's own refusal otherwise

    path = profile(tmp_path, online)
    with pytest.raises(ParamsError, match="curve.fractions trains on the hidden-state store"):
        load_params(path)
    assert yaml.safe_load(path.read_text())["curve"]["fractions"] == [0.125, 0.25, 0.5]
