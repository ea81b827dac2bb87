"""What every plan answers: GPUs (count, memory each), disk per node and in all (the verifier's
weights, the hidden states, the checkpoints), hours at rates whose source exists; numbers typed
on the command line checked; the flagship planned from the repo alone (shipped configs)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from builders import fake_verifier
from plan_cases import AQ_MEDAI, KIMI, PROFILE, REPO

from eagle3_pipeline.cli import main
from eagle3_pipeline.config.params import load_params
from eagle3_pipeline.core.errors import PipelineError
from eagle3_pipeline.plan import inputs, modes, nodes, plan, report

SHIPPED = {
    REPO / "profiles/configs/Kimi-K2.5/config.json": KIMI,
    REPO / "profiles/configs/AQ-MedAI-Kimi-K25-eagle3/config.json": AQ_MEDAI,
}


@pytest.mark.parametrize(
    "argv",
    [
        ["--tokens", "-5"],
        ["--tokens", "0"],
        ["--prompts", "-1"],
        ["--prompts", "0"],
        ["--target-tau", "0.5"],
        ["--samples", "600k:0"],
    ],
)
def test_numbers_below_one_are_refused_in_one_line(capsys, argv: list[str]) -> None:
    assert main(["plan", "--params", str(PROFILE), *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and argv[0] in err and "TB" not in err


def test_kimi_plans_from_the_shipped_configs(capsys) -> None:
    """README's command, with no weights here and no flag: the shipped configs, said so."""
    assert not Path("/models/Kimi-K2.5").exists()
    assert main(["plan", "--params", "profiles/kimi-k2.5.yaml", "--samples", "600k"]) == 0
    out = capsys.readouterr().out
    assert (
        "shipped     verifier config: profiles/configs/Kimi-K2.5/config.json (weights not at "
        "/models/Kimi-K2.5; planned from the shipped config)"
    ) in out
    assert "init config: profiles/configs/AQ-MedAI-Kimi-K25-eagle3/config.json" in out
    assert "gpus        8 per node x 1 node = 8, 139 GiB each (vllm.gpu_memory_gib)" in out
    assert "disk        10.34 TB per node and in all (1 node) = verifier weights 593.87 GB" in out
    assert re.search(r"^hours       generate .* = ~[\d.]+ h", out, re.M)
    assert "not here    /models/Kimi-K2.5/config.json: not found (verifier.path" in out


def test_shipped_configs_are_the_fixtures() -> None:
    for shipped, fixture in SHIPPED.items():
        assert shipped.read_bytes() == fixture.read_bytes()


def test_a_folder_with_its_config_is_read_not_the_shipped_one(tmp_path: Path, monkeypatch) -> None:
    folder = fake_verifier(tmp_path / "Kimi-K2.5", KIMI)
    params = load_params(PROFILE)
    params.verifier.path = str(folder)
    monkeypatch.chdir(REPO)
    _, file, note = inputs.load_verifier_config(params, None)
    assert (file, note) == (folder / "config.json", None)


def test_the_weights_are_one_number(capsys) -> None:
    """vLLM's weights per GPU and the disk per node come from one figure (memory.py)."""
    p = plan.make_plan(load_params(PROFILE), PROFILE, KIMI, AQ_MEDAI)
    assert p.serving is not None and p.summary is not None
    assert p.summary.weights == p.serving.weights
    assert round(p.summary.weights.bytes / 1e9, 2) == 593.87


@pytest.mark.parametrize(
    "profile", sorted((REPO / "profiles").glob("*.yaml")), ids=lambda p: p.stem
)
def test_every_profile_answers_gpus_disk_and_hours(profile: Path, monkeypatch) -> None:
    """Or is refused in one line naming the path to set (a model folder this machine lacks)."""
    monkeypatch.chdir(REPO)
    rel = profile.relative_to(REPO)
    try:
        p = plan.make_plan(load_params(rel), rel)
    except PipelineError as exc:
        assert profile.stem in ("pretrained", "smollm2", "smollm2-2x")
        # no model fetched (make real-model), or its public prompt sets not (eagle3 fetch-prompts)
        assert f"config.json: not found (verifier.path in {rel})" in str(exc) or (
            "(evaluate.public_sets) not fetched: run `eagle3 fetch-prompts`" in str(exc)
        )
        return
    text = report.render(p)
    for label in ("gpus", "disk", "hours", "rates"):
        assert re.search(rf"^{label} +\S", text, re.M), label
    assert "unknown" not in text.split("\ngpus")[1]


def test_rates_cite_files_in_the_repo_or_say_assumed() -> None:
    for rates in nodes.RATES.values():
        cited = re.findall(r"[\w./-]+/[\w.-]+\.(?:json|md|py)", rates.source)
        assert all((REPO / c).is_file() for c in cited), cited
        assert "bench/results/online.json" not in rates.source


def test_parse_samples_tokens_at_least_one_per_sample() -> None:
    with pytest.raises(PipelineError, match="fewer tokens than samples"):
        modes.parse_samples("10k:5k")
