"""Hidden states in both modes (store, online): disk and verifier prefill, at the plan's sample
count and at the counts `--samples` asks for, on the Kimi-K2.5 fixture config.

Expected values are worked out here from params and the verifier's config.json, not through the
plan's code: a wrong figure in modes.py or the report fails these tests.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from plan_cases import AQ_MEDAI, KIMI, KIMI_ARGS, PROFILE, kimi_plan, profile

from eagle3_pipeline.cli import main
from eagle3_pipeline.config.params import load_params
from eagle3_pipeline.core.errors import ParamsError
from eagle3_pipeline.plan import modes, plan, report

HIDDEN = json.loads(KIMI.read_text())["text_config"]["hidden_size"]  # 7,168
ASSUMED_PROMPT = 256  # no prompt files beside the profile: the plan assumes 256 prompt tokens


def bf16_per_token(params) -> int:
    """Aux layers + the final one, hidden values each, 2 bytes a value."""
    return (len(params.layers.aux_layer_ids) + 1) * HIDDEN * 2


def fp8_per_token(params) -> int:
    """1 byte a value plus one fp32 scale per token and layer."""
    layers = len(params.layers.aux_layer_ids) + 1
    return layers * HIDDEN + layers * 4


def size(n: float) -> str:
    return f"{n / 1e12:,.2f} TB" if n >= 1e12 else f"{n / 1e9:,.2f} GB"


def rows(text: str) -> list[str]:
    """The report's lines with runs of spaces squeezed, so a table row reads as one string."""
    return [" ".join(line.split()) for line in text.splitlines()]


def test_kimi_bytes_per_token_and_the_sanity_figures() -> None:
    """57,344 B/token in bf16; 10k traces of 14.44M tokens ~828 GB; 600k samples of 6B ~344 TB."""
    params = load_params(PROFILE)
    assert bf16_per_token(params) == 4 * 7168 * 2 == 57_344
    p = kimi_plan(samples=[(10_000, 14_440_000), (600_000, 6_000_000_000)])
    traces, big = p.scales[1], p.scales[2]
    assert p.disk_bytes(traces.store)["bf16"] == 14_440_000 * 57_344  # 828.05 GB
    assert p.disk_bytes(big.store)["bf16"] == 6_000_000_000 * 57_344  # 344.06 TB
    assert 827e9 < 14_440_000 * 57_344 < 829e9 and 343e12 < 6e9 * 57_344 < 345e12
    text = rows(report.render(p))
    assert any(r.startswith("10,000 x 1,444 = 14.4M 828.05 GB (414.25 GB) 14.4M") for r in text)
    assert any(r.startswith("600,000 x 10,000 = 6,000.0M 344.06 TB (172.13 TB)") for r in text)


def test_kimi_both_modes_at_the_plans_sample_count() -> None:
    """Store: every sample on disk, prefilled once. Online: the val samples extract keeps on
    disk (the 200 evaluate reads: extract.online_keep_val), every other one prefilled each
    epoch."""
    params = load_params(PROFILE)
    assert params.train.hidden_states == "store" and params.extract.online_keep_val == 200
    assert params.evaluate.max_offline_samples == 200
    n = params.prepare.max_prompts  # no prompt files: the count is the cap
    per_sample = min(ASSUMED_PROMPT + params.generate.max_new_tokens, params.tokenize.max_seq_len)
    tokens = n * per_sample
    assert (n, per_sample, tokens) == (10_000, 16_640, 166_400_000)
    val = int(n * params.prepare.val_ratio + 0.5)
    kept = 200
    val_tokens = kept * per_sample
    epochs = params.train.epochs
    online_prefill = epochs * (tokens - val_tokens) + val_tokens
    assert (val, online_prefill) == (1_000, 818_688_000)

    p = kimi_plan()
    (own,) = p.scales
    assert (own.samples, own.tokens, own.val_samples, own.how) == (n, tokens, val, "plan")
    assert own.store == modes.ModeCost(n, tokens, tokens)
    assert own.online == modes.ModeCost(kept, val_tokens, online_prefill)
    store_disk = {"bf16": tokens * bf16_per_token(params), "fp8": tokens * fp8_per_token(params)}
    assert p.disk_bytes(own.store) == store_disk
    assert p.disk_bytes(own.online)["bf16"] == val_tokens * 57_344

    text = report.render(p)
    assert "train.hidden_states: store (*)" in text
    assert "the first 200 val samples by id (extract.online_keep_val)" in text
    lines = rows(text)
    header = next(r for r in lines if r.startswith("samples x each"))
    assert "*store disk" in header and "*online" not in header
    expected = (
        f"10,000 x 16,640 = 166.4M {size(store_disk['bf16'])} ({size(store_disk['fp8'])}) "
        f"166.4M {size(val_tokens * 57_344)} ({size(val_tokens * 28_688)}) 200 818.7M plan"
    )
    assert expected == (
        "10,000 x 16,640 = 166.4M 9.54 TB (4.77 TB) 166.4M 190.84 GB (95.47 GB) 200 818.7M plan"
    )
    assert expected in lines


def test_online_mode_keeps_only_the_val_samples_asked(tmp_path: Path) -> None:
    """extract.online_keep_val: 200 of 60,000 val samples on disk at 600k samples; the other
    599,800 samples are prefilled in each of the 5 epochs."""

    def online(p: dict) -> None:
        p["train"]["hidden_states"] = "online"
        p["train"]["num_workers"] = 0  # the server train starts wants a key workers lack
        p["curve"]["fractions"] = []  # the fractions read the store online mode does not write
        p["extract"]["online_keep_val"] = 200

    params_path = profile(tmp_path, online)
    params = load_params(params_path)
    p = plan.make_plan(params, params_path, KIMI, AQ_MEDAI, samples=[(600_000, 6_000_000_000)])
    own, big = p.scales
    kept_tokens = 200 * 10_000
    assert big.val_samples == 60_000
    prefill = 5 * (6_000_000_000 - kept_tokens) + kept_tokens
    assert big.online == modes.ModeCost(200, kept_tokens, prefill)
    assert big.online.prefill_tokens == 29_992_000_000
    assert p.disk_bytes(big.online)["bf16"] == kept_tokens * 57_344  # 114.69 GB
    # At the plan's own 10,000 samples: 200 of 1,000 val samples kept.
    assert own.online.disk_tokens == 200 * 16_640
    assert own.online.prefill_tokens == 5 * (166_400_000 - 200 * 16_640) + 200 * 16_640
    text = report.render(p)
    assert "train.hidden_states: online (*)" in text
    assert "the first 200 val samples by id (extract.online_keep_val)" in text
    lines = rows(text)
    assert "*online disk" in next(r for r in lines if r.startswith("samples x each"))
    assert (
        "600,000 x 10,000 = 6,000.0M 344.06 TB (172.13 TB) 6,000.0M 114.69 GB (57.38 GB) 200 "
        "29,992.0M --samples" in lines
    )
    assert not any("online_keep_val" in w for w in p.warnings)  # 200 = max_offline_samples


def test_online_keep_val_below_what_evaluate_simulates_warns(tmp_path: Path) -> None:
    def fewer(p: dict) -> None:
        p["train"]["hidden_states"] = "online"
        p["train"]["num_workers"] = 0  # the server train starts wants a key workers lack
        p["curve"]["fractions"] = []  # the fractions read the store online mode does not write
        p["extract"]["online_keep_val"] = 100  # evaluate.max_offline_samples is 200

    params_path = profile(tmp_path, fewer)
    p = plan.make_plan(load_params(params_path), params_path, KIMI, AQ_MEDAI)
    assert any(
        w.startswith("extract.online_keep_val 100 < evaluate.max_offline_samples")
        for w in p.warnings
    )
    params = load_params(params_path)
    params.train.hidden_states = "store"  # the store keeps every sample: nothing to warn
    assert not any(
        "online_keep_val" in w for w in plan.make_plan(params, params_path, KIMI, AQ_MEDAI).warnings
    )


def test_cli_samples_rows_follow_the_plans_mean(capsys) -> None:
    """`--samples 10k,600k:6B`: 10k at the plan's 16,640 per sample, 600k at 6B tokens."""
    rc = main(["plan", "--params", str(PROFILE), *KIMI_ARGS, "--samples", "10k,600k:6B"])
    out = capsys.readouterr().out
    assert rc == 0
    lines = rows(out)
    table = [r for r in lines if r.endswith(("plan", "--samples"))]
    assert [r.split()[0] for r in table] == ["10,000", "10,000", "600,000"]
    assert table[0].removesuffix("plan") == table[1].removesuffix("--samples")
    assert table[2].startswith("600,000 x 10,000 = 6,000.0M 344.06 TB (172.13 TB) 6,000.0M")
    # 200 of the 60,000 val samples kept (those evaluate reads); 5 epochs of the other tokens.
    assert table[2].endswith("114.69 GB (57.38 GB) 200 29,992.0M --samples")


def test_tokens_with_prompts_set_the_mean_per_sample() -> None:
    p = kimi_plan(tokens=81_920_000, prompts=20_000, samples=[(600_000, None)])
    own, asked = p.scales
    assert (own.samples, own.tokens_per_sample) == (20_000, 4_096)
    assert asked.tokens == 600_000 * 4_096


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("10000", [(10_000, None)]),
        ("10k,600K:6B", [(10_000, None), (600_000, 6_000_000_000)]),
        ("10k:14.44M, 1.2t", [(10_000, 14_440_000), (1_200_000_000_000, None)]),
    ],
)
def test_parse_samples(text: str, expected: list) -> None:
    assert modes.parse_samples(text) == expected


@pytest.mark.parametrize("text", ["10,000", "ten", "0", "10k:", "10k:6X", "-5"])
def test_bad_samples_are_one_line(capsys, text: str) -> None:
    with pytest.raises(ParamsError, match="--samples"):
        modes.parse_samples(text)
    rc = main(["plan", "--params", str(PROFILE), *KIMI_ARGS, "--samples", text])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "--samples" in err


def test_samples_without_a_mean_per_sample_refused(tmp_path: Path) -> None:
    """--tokens with no prompt count leaves the tokens per sample unknown: N alone is refused."""

    def no_count(p: dict) -> None:
        p["prepare"].update(max_prompts=None, prompts=str(tmp_path / "missing"))

    params_path = profile(tmp_path, no_count)
    params = load_params(params_path)
    p = plan.make_plan(params, params_path, KIMI, AQ_MEDAI, tokens=1_000_000)
    assert p.scales == [] and "sample count unknown" in report.render(p)
    with pytest.raises(ParamsError, match="write 10000:TOKENS"):
        plan.make_plan(params, params_path, KIMI, AQ_MEDAI, 1_000_000, samples=[(10_000, None)])
    p = plan.make_plan(params, params_path, KIMI, AQ_MEDAI, 1_000_000, samples=[(10, 1000)])
    assert p.scales[0].store.disk_tokens == 1000
