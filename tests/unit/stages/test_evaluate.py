"""evaluate: the stage's online glue with stand-in runs (the mismatch line, differing greedy
outputs, near ties, no val prompts); the module's own: tests/unit/evaluation/test_online.py, real
vLLM servers: tests/integration/test_evaluate_online.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from online_runs import fake_run, write_val_prompts

from eagle3_pipeline.errors import DataError, ServerError
from eagle3_pipeline.evaluation import online as oe
from eagle3_pipeline.evaluation.losslessness import TokenLogprobs
from eagle3_pipeline.params import Params
from eagle3_pipeline.serving.server import ServerSpec
from eagle3_pipeline.stages import evaluate


def test_mismatch_rule() -> None:
    assert evaluate.is_mismatch(online_mal=1.2, offline_mal=3.0, ratio=0.5)
    assert not evaluate.is_mismatch(online_mal=2.2, offline_mal=3.0, ratio=0.5)
    assert not evaluate.is_mismatch(online_mal=1.0, offline_mal=1.0, ratio=0.5)


@pytest.fixture
def stage_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    write_val_prompts(tmp_path)
    return tmp_path


def _params(**evaluate_params: Any) -> Params:
    return Params.model_validate(
        {"evaluate": {"online": True, "max_eval_prompts": 3, **evaluate_params}}
    )


def test_stage_online_section_and_mismatch_line(
    stage_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    seen: list[tuple[ServerSpec, int, oe.Settings]] = []

    def fake(spec: ServerSpec, conversations: list, settings: oe.Settings) -> oe.RunResult:
        seen.append((spec, len(conversations), settings))
        if spec.speculative_config:
            return fake_run([[1, 2, 3]] * 3, wall=1.0, drafts=6, accepted=3)
        return fake_run([[1, 2, 3]] * 3, wall=2.0, drafts=0, accepted=0)

    monkeypatch.setattr(oe, "serve_and_measure", fake)
    params = _params(mismatch_ratio=0.5)
    section, mismatched, verdict = evaluate.run_online(params)
    out = evaluate.online_verdict(section, 3.0, mismatched, params, verdict)

    assert [s.speculative_config for s, _, _ in seen] == [
        None,
        {"method": "eagle3", "model": "models/drafter", "num_speculative_tokens": 3},
    ]
    assert all(n == 3 for _, n, _ in seen)
    assert seen[0][2] == seen[1][2] and seen[0][2].concurrency == params.evaluate.concurrency
    assert seen[0][0].model == params.verifier.path
    assert out["greedy_outputs_identical"] is True
    assert out["lossless"]["verdict"] == "identical"
    assert seen[0][2].top_logprobs == params.evaluate.top_logprobs
    assert seen[0][2].near_tie_nats == params.evaluate.near_tie_nats
    assert out["mismatch"] is True  # 1.5 - 1 < 0.5 * (3.0 - 1)
    online = out["online"]
    assert online["mean_acceptance_length"] == pytest.approx(1.5)
    assert online["tokens_per_s"] == 9 and online["tokens_per_s_baseline"] == 4.5
    assert online["speedup"] == pytest.approx(2.0)
    assert online["num_prompts"] == 3
    lines = [x for x in capsys.readouterr().out.splitlines() if "MISMATCH" in x]
    assert len(lines) == 1
    for cause in ("layer ids", "d2t/t2d", "norm_before_fc/norm_output", "verifier"):
        assert cause in lines[0]


def test_stage_reports_differing_greedy_outputs(
    stage_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def fake(spec: ServerSpec, conversations: list, settings: oe.Settings) -> oe.RunResult:
        tokens = [[1, 2], [3, 4], [5, 6]]
        if spec.speculative_config:
            tokens[1] = [3, 5]
        return fake_run(tokens, wall=1.0, drafts=4, accepted=4)

    monkeypatch.setattr(oe, "serve_and_measure", fake)
    params = _params()
    section, mismatched, verdict = evaluate.run_online(params)
    out = evaluate.online_verdict(section, 2.0, mismatched, params, verdict)
    assert mismatched == ["p1"]
    assert out["greedy_outputs_identical"] is False
    assert out["online"]["greedy_mismatched_ids"] == ["p1"]
    assert out["mismatch"] is False
    assert out["lossless"]["verdict"] == "diverged"
    with pytest.raises(ServerError, match=r"where the baseline was sure, on 1 of 3 .*prompt p1 at"):
        evaluate.require_lossless(verdict)


def test_stage_passes_near_ties_and_records_them(
    stage_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tie = {5: -0.70, 6: -0.73}  # the two runs' top-2 swap, 0.03 nats apart

    def fake(spec: ServerSpec, conversations: list, settings: oe.Settings) -> oe.RunResult:
        chosen = 6 if spec.speculative_config else 5
        run = fake_run([[1, 2], [3, chosen], [5, 6]], wall=1.0, drafts=4, accepted=4)
        run.logprobs = [
            None,
            [TokenLogprobs(3, -0.1, {3: -0.1}), TokenLogprobs(chosen, tie[chosen], tie)],
            None,
        ]
        return run

    monkeypatch.setattr(oe, "serve_and_measure", fake)
    params = _params()
    section, mismatched, verdict = evaluate.run_online(params)
    out = evaluate.online_verdict(section, 2.0, mismatched, params, verdict)
    evaluate.require_lossless(verdict)  # passes
    assert out["greedy_outputs_identical"] is False and mismatched == ["p1"]
    lossless = out["lossless"]
    assert (lossless["verdict"], lossless["num_near_ties"], lossless["num_identical"]) == (
        "near_ties",
        1,
        2,
    )
    (row,) = lossless["near_tie_positions"]
    assert (row["prompt"], row["position"]) == ("p1", 1)
    assert row["margin_nats"] == pytest.approx(0.03)


def test_stage_without_val_prompts_is_one_line_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataError, match="val.jsonl: not found"):
        evaluate.run_online(_params())
