"""`eagle3 plan` on a Ray cluster: each node's share of the work, its disk and its time."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from plan_cases import AQ_MEDAI, KIMI, KIMI_ARGS, REPO

from eagle3_pipeline.cli import main
from eagle3_pipeline.config.params import load_params
from eagle3_pipeline.plan import nodes, plan, report

FOUR_NODES = REPO / "profiles/kimi-k2.5-4nodes.yaml"
TINY_CLUSTER = REPO / "profiles/tiny-llama-cluster.yaml"


def four_nodes_plan(**overrides) -> plan.Plan:
    return plan.make_plan(load_params(FOUR_NODES), FOUR_NODES, KIMI, AQ_MEDAI, **overrides)


@pytest.mark.parametrize(("total", "parts"), [(10, 3), (7, 7), (3, 5), (0, 2), (10_001, 2)])
def test_split_is_exact_and_even(total: int, parts: int) -> None:
    shares = nodes.split(total, parts)
    assert len(shares) == parts and sum(shares) == total
    assert max(shares) - min(shares) <= 1


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(30, "< 1 min"), (61, "2 min"), (3 * 3600, "3.0 h"), (3 * 86400, "3.0 d")],
)
def test_duration(seconds: float, text: str) -> None:
    assert nodes.duration(seconds) == text


def test_four_nodes_split_the_plans_totals() -> None:
    p = four_nodes_plan(tokens=81_920_000)  # over the profile's 10,000 prompts: 8,192 each
    c = p.cluster
    assert c is not None and (len(c.inference), len(c.training)) == (2, 2)
    assert [s.samples for s in c.inference] == [5_000, 5_000]
    assert sum(s.tokens for s in c.inference) == 81_920_000
    # Each inference node writes half the store to the shared data/, in bf16.
    assert [s.store_bytes for s in c.inference] == [40_960_000 * 57_344] * 2
    # 16 ranks: the global batch doubles (2 nodes x 8 ranks x 20,480), the steps halve.
    assert p.global_batch_tokens == 16 * 20_480
    assert p.steps_per_epoch == -(-73_728_000 // (16 * 20_480))
    assert [t.ranks for t in c.training] == [8, 8]
    assert sum(t.tokens_per_epoch for t in c.training) == p.train_tokens
    assert [t.writes_checkpoints for t in c.training] == [True, False]
    # Time: a share's tokens over the reference rates.
    gpu = nodes.RATES["gpu"]
    assert c.inference[0].extract_s == pytest.approx(40_960_000 / gpu.extract_per_node)
    assert c.training[0].train_s == pytest.approx(5 * 36_864_000 / (8 * gpu.train_per_rank))
    assert c.stage_seconds["train"] == max(t.train_s for t in c.training)


def test_generate_time_follows_what_the_kv_cache_holds() -> None:
    c = four_nodes_plan(tokens=81_920_000).cluster
    assert c is not None and c.concurrency == 36  # generate.concurrency; the KV cache holds more
    new = c.inference[0].new_tokens
    assert new == 40_960_000 - 5_000 * 256  # prompt tokens assumed: no prompt files here
    assert c.inference[0].generate_s == pytest.approx(new / (36 * 30.0))


def test_online_mode_writes_only_the_kept_val_samples(tmp_path: Path) -> None:
    raw = yaml.safe_load(FOUR_NODES.read_text())
    raw["train"]["hidden_states"] = "online"
    raw["train"]["num_workers"] = 0  # the servers' key would not reach loader workers
    raw["curve"]["fractions"] = []  # the fractions read the store online mode does not write
    raw["extract"]["online_keep_val"] = 200
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(raw))
    p = plan.make_plan(load_params(path), path, KIMI, AQ_MEDAI, tokens=81_920_000)
    assert p.cluster is not None
    assert sum(s.store_tokens for s in p.cluster.inference) == 200 * 8_192


def test_cli_prints_each_nodes_work_disk_and_time(capsys) -> None:
    rc = main(["plan", "--params", str(FOUR_NODES), *KIMI_ARGS, "--tokens", "81920000"])
    out = " ".join(capsys.readouterr().out.split())
    assert rc == 0
    assert "cluster Ray at auto: each worker asks 8 CPU, 8 GPUs" in out
    assert "inference 1 generate 5,000 prompts" in out and "inference 2 generate" in out
    assert "extract 41.0M tokens prefilled 2.35 TB bf16" in out
    assert "training 1 train 8 ranks, 36.9M tokens x 5 epochs checkpoints" in out
    assert "training 2 train 8 ranks" in out
    assert "stages in turn, each as long as its slowest node: generate" in out
    assert "~49.09 GB per rank (16 x ddp)" in out


def test_local_engine_prints_no_nodes() -> None:
    p = plan.make_plan(load_params(REPO / "profiles/kimi-k2.5.yaml"), "k", KIMI, AQ_MEDAI, tokens=1)
    assert p.cluster is None and "cluster" not in report.render(p)
    assert p.global_batch_tokens == 8 * 20_480


def test_tiny_cluster_plans_two_nodes_on_cpu_rates(tmp_path: Path) -> None:
    params = load_params(TINY_CLUSTER).model_copy(deep=True)
    params.verifier.path = str(tmp_path / "not-built")
    p = plan.make_plan(params, TINY_CLUSTER, prompts=10)
    assert p.cluster is not None and p.cluster.rates is nodes.RATES["cpu"]
    assert [s.samples for s in p.cluster.inference] == [5, 5]
    assert [t.ranks for t in p.cluster.training] == [1, 1]
    assert p.cluster.verifier_bytes is None  # no GPU memory named: weights not sized


@pytest.mark.parametrize(
    ("cluster_profile", "base"),
    [(TINY_CLUSTER, "tiny-llama"), (FOUR_NODES, "kimi-k2.5")],
)
def test_cluster_profiles_differ_from_their_base_in_the_cluster_block_only(
    cluster_profile: Path, base: str
) -> None:
    ours = yaml.safe_load(cluster_profile.read_text())
    theirs = yaml.safe_load((REPO / f"profiles/{base}.yaml").read_text())
    assert ours.pop("profile") == cluster_profile.stem and theirs.pop("profile") == base
    cluster = ours.pop("cluster")
    # Every key of the base's block is set here too: DVC reads cluster.* as train params.
    assert set(theirs.pop("cluster", {})) <= set(cluster)
    assert ours == theirs
    assert cluster["engine"] == "ray" and cluster["nodes"] == 2
    assert load_params(cluster_profile).cluster.engine == "ray"


def test_unknown_sample_count_says_so(tmp_path: Path) -> None:
    raw = yaml.safe_load(FOUR_NODES.read_text())
    raw["prepare"]["max_prompts"] = None  # and no prompt files: nothing to split
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(raw))
    p = plan.make_plan(load_params(path), path, KIMI, AQ_MEDAI)
    assert p.cluster is not None and p.cluster.inference == [] and p.cluster.training == []
    text = report.render(p)
    assert "generate, extract: sample count unknown" in text and "stages in turn" not in text
