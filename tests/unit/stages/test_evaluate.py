"""evaluate: the stage's online glue with stand-in runs (the mismatch line, differing greedy
outputs, near ties, no val prompts); the module's own: tests/unit/evaluation/test_online.py, real
vLLM servers: tests/integration/test_evaluate_online.py."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import pytest
from builders import fake_verifier, make_params
from online_runs import fake_run, stepped_run, write_val_prompts

from eagle3_pipeline.config.params import Params
from eagle3_pipeline.core.errors import DataError, ServerError
from eagle3_pipeline.evaluation import headline, prompt_sets
from eagle3_pipeline.evaluation import online as oe
from eagle3_pipeline.evaluation import verdict as rules
from eagle3_pipeline.evaluation.losslessness import TokenLogprobs
from eagle3_pipeline.serving.server import ServerSpec
from eagle3_pipeline.stages import evaluate


def test_mismatch_rule() -> None:
    assert rules.is_mismatch(online_mal=1.2, offline_mal=3.0, ratio=0.5)
    assert not rules.is_mismatch(online_mal=2.2, offline_mal=3.0, ratio=0.5)
    assert not rules.is_mismatch(online_mal=1.0, offline_mal=1.0, ratio=0.5)


@pytest.fixture
def stage_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The val prompts, and the verifier's config.json the stage reads its facts from."""
    monkeypatch.chdir(tmp_path)
    write_val_prompts(tmp_path)
    fake_verifier(tmp_path / "data/verifier")
    return tmp_path


def _served_by(monkeypatch: pytest.MonkeyPatch, fake: oe.Runner) -> None:
    """`fake` measures on the servers the stage would start (no vLLM): the full passes and the
    paired rounds alike."""

    @contextlib.contextmanager
    def servers_up(specs: list[ServerSpec], together: bool):
        yield fake

    monkeypatch.setattr(oe, "servers_up", servers_up)


def _full_passes(seen: list) -> list:
    """The calls that were full passes (they ask logprobs for the verdict; rounds do not)."""
    return [call for call in seen if call[2].top_logprobs]


# Online evaluation on the 3 val prompts of `stage_dir`.
ONLINE = {"evaluate": {"online": True, "max_eval_prompts": 3}}


def test_stage_online_section_and_mismatch_line(
    stage_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    seen: list[tuple[ServerSpec, int, oe.Settings]] = []

    def fake(spec: ServerSpec, conversations: list, settings: oe.Settings) -> oe.RunResult:
        seen.append((spec, len(conversations), settings))
        if spec.speculative_config:
            return fake_run([[1, 2, 3]] * 3, wall=1.0, drafts=6, accepted=3)
        return fake_run([[1, 2, 3]] * 3, wall=2.0, drafts=0, accepted=0)

    _served_by(monkeypatch, fake)
    params = make_params(ONLINE, evaluate={"mismatch_ratio": 0.5})
    section, mismatched, verdict = evaluate.run_online(params)
    out = rules.online_verdict(section, 3.0, mismatched, params.evaluate, verdict)

    rounds = [call for call in seen if not call[2].top_logprobs]
    assert len(rounds) == 2 * params.evaluate.speedup_rounds
    seen = _full_passes(seen)
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


def test_public_sets_lead_eval_json_and_leave_out_what_training_holds(
    stage_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """HumanEval (installed with the lock) served beside val: the prompt that the training
    prompts hold is left out, the set's figures and the lowest set head `served`."""
    first, second, third = prompt_sets.chosen(prompt_sets.load("humaneval").prompts)[:3]
    train = stage_dir / "data/prepared/train.jsonl"
    train.write_text(json.dumps({"id": "t0", "messages": first.messages}) + "\n")
    public_ids: list[list[str]] = []

    def fake(spec: ServerSpec, conversations: list, settings: oe.Settings) -> oe.RunResult:
        public = "Python function" in conversations[0][0]["content"]
        if public and settings.top_logprobs:
            public_ids.append([c[0]["content"] for c in conversations])
        tokens = [[1, 2, 3, 4, 5]] * len(conversations)
        if not spec.speculative_config:
            return fake_run(tokens, wall=2.0, drafts=0, accepted=0)
        return stepped_run(tokens, [[1, 0] if public else [3]] * len(conversations))

    _served_by(monkeypatch, fake)
    params = make_params(
        ONLINE, evaluate={"public_sets": ["humaneval"], "public_set_prompts": 2, "answer_window": 4}
    )
    section, mismatched, verdict = evaluate.run_online(params, held_out=True)
    held = section.pop("held_out")
    online = rules.online_verdict(section, 3.0, mismatched, params.evaluate, verdict)["online"]
    served = headline.served_headline(online, held, params.evaluate, evaluate.VAL_PROMPTS)

    assert public_ids[0] == [second.messages[0]["content"], third.messages[0]["content"]]
    he = served["sets"]["humaneval"]
    assert he["num_prompts"] == 2 and first.id in he["left_out_as_duplicates"]
    assert he["mean_acceptance_length"] == pytest.approx(1.5)
    assert served["sets"]["val"]["mean_acceptance_length"] == pytest.approx(4.0)
    assert served["lowest_set"] == "humaneval"
    assert served["lowest_mean_acceptance_length"] == pytest.approx(1.5)
    assert list(served["sets"]) == ["val", "humaneval"]
    assert served["sets"]["val"]["speedup_by_concurrency"]["1"]["speedup"] == pytest.approx(2.0)
    assert verdict.num_prompts == 5


def test_stage_reports_differing_greedy_outputs(
    stage_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def fake(spec: ServerSpec, conversations: list, settings: oe.Settings) -> oe.RunResult:
        tokens = [[1, 2], [3, 4], [5, 6]]
        if spec.speculative_config:
            tokens[1] = [3, 5]
        return fake_run(tokens, wall=1.0, drafts=4, accepted=4)

    _served_by(monkeypatch, fake)
    params = make_params(ONLINE)
    section, mismatched, verdict = evaluate.run_online(params)
    out = rules.online_verdict(section, 2.0, mismatched, params.evaluate, verdict)
    assert mismatched == ["p1"]
    assert out["greedy_outputs_identical"] is False
    assert out["online"]["greedy_mismatched_ids"] == ["p1"]
    assert out["mismatch"] is False
    assert out["lossless"]["verdict"] == "diverged"
    with pytest.raises(ServerError, match=r"where the baseline was sure, on 1 of 3 .*prompt p1 at"):
        rules.require_lossless(verdict, Path("logs"))


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

    _served_by(monkeypatch, fake)
    params = make_params(ONLINE)
    section, mismatched, verdict = evaluate.run_online(params)
    out = rules.online_verdict(section, 2.0, mismatched, params.evaluate, verdict)
    rules.require_lossless(verdict, Path("logs"))  # passes
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
        evaluate.run_online(make_params(ONLINE))


# --- the like-for-like alarm -----------------------------------------------------------------


def test_relative_rule_is_a_shortfall_in_accepted_tokens_per_draft() -> None:
    assert rules.relative_gap(2.8, 3.0) == pytest.approx(-0.1)
    assert rules.is_short(2.7, 3.0, 0.1)  # 1.7 vs 2.0 accepted per draft: 15% short
    assert not rules.is_short(2.96, 3.0, 0.1)  # 2% short: a right drafter
    assert not rules.is_short(3.6, 3.0, 0.1)  # more than simulated: no cause named fits
    assert rules.relative_gap(1.2, 1.0) is None and not rules.is_short(1.0, 1.0, 0.1)


def _section(mal: float) -> dict[str, Any]:
    return {
        "mean_acceptance_length": mal,
        "acceptance_rate": (mal - 1) / 3,
        "tokens_per_s": 2.0,
        "tokens_per_s_baseline": 1.0,
        "speedup": 2.0,
        "num_prompts": 3,
    }


def test_alarm_compares_with_the_same_prompts_figure(capsys: pytest.CaptureFixture) -> None:
    params = make_params(ONLINE)
    same = {"mean_acceptance_length": 2.5, "num_drafts": 100}
    # whole val says 3.2 (the coarse rule is quiet: 1.3 >= 0.5 x 2.2); same prompts say 2.5
    out = rules.online_verdict(_section(2.3), 3.2, [], params.evaluate, offline_same=same)
    assert out["mismatch"] is True  # 1.3 vs 1.5 accepted per draft: 13% short
    rule = out["mismatch_rule"]
    assert rule["compared_with"] == "offline_same_prompts"
    assert rule["relative_gap"] == pytest.approx(-0.2 / 1.5)
    assert rule["mismatch_tolerance"] == params.evaluate.mismatch_tolerance == 0.1
    lines = [x for x in capsys.readouterr().out.splitlines() if "MISMATCH" in x]
    assert len(lines) == 1 and "evaluate.mismatch_tolerance=0.1" in lines[0]
    out = rules.online_verdict(_section(2.47), 3.2, [], params.evaluate, offline_same=same)
    assert out["mismatch"] is False  # 2% short


def test_each_swept_count_is_logged_beside_its_simulated_walk(
    capsys: pytest.CaptureFixture,
) -> None:
    same = {
        "mean_acceptance_length": 2.5,
        "num_drafts": 100,
        "by_num_speculative_tokens": {"2": 2.1},
    }
    rows = {"2": _section(2.1) | {"speedup": 2.4}, "3": _section(2.5)}
    section = _section(2.5) | {"by_num_speculative_tokens": rows, "best_num_speculative_tokens": 2}
    out = rules.online_verdict(section, 3.2, [], make_params(ONLINE).evaluate, offline_same=same)
    key = "offline_same_prompts_mean_acceptance_length"
    by = out["online"]["by_num_speculative_tokens"]
    assert by["2"][key] == 2.1 and by["3"][key] == 2.5 and out["mismatch"] is False
    lines = [x for x in capsys.readouterr().out.splitlines() if "drafts:" in x]
    assert lines == [
        "[evaluate] vLLM at 2 drafts: mean acceptance length 2.100 (simulated 2.100), x2.40"
        " <- best",
        "[evaluate] vLLM at 3 drafts: mean acceptance length 2.500 (simulated 2.500), x2.00",
    ]


def test_alarm_falls_back_to_the_ratio_without_a_same_prompts_figure() -> None:
    params = make_params(ONLINE, evaluate={"mismatch_ratio": 0.5})
    out = rules.online_verdict(_section(2.3), 3.2, [], params.evaluate)
    assert out["mismatch"] is False and out["mismatch_rule"]["compared_with"] == "offline"
    empty = {"mean_acceptance_length": 1.0, "num_drafts": 0}  # no online prompt in the store
    out = rules.online_verdict(_section(1.2), 3.2, [], params.evaluate, offline_same=empty)
    assert out["mismatch"] is True and out["mismatch_rule"]["mismatch_ratio"] == 0.5


def test_second_concurrency_is_timed_in_its_own_paired_rounds(
    stage_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each of evaluate.throughput_concurrency gets its own paired rounds (at least two waves of
    requests each), its row its own speed-up and the acceptance of the drafter's rounds there."""
    seen: list[tuple[bool, int, int, bool]] = []

    def fake(spec: ServerSpec, conversations: list, settings: oe.Settings) -> oe.RunResult:
        drafter = bool(spec.speculative_config)
        seen.append(
            (drafter, settings.concurrency, len(conversations), bool(settings.top_logprobs))
        )
        wall = (0.5 if drafter else 1.0) / (4 if settings.concurrency == 16 else 1)
        return fake_run([[1, 2]] * len(conversations), wall, drafts=4 * drafter, accepted=4)

    _served_by(monkeypatch, fake)
    params = make_params(
        ONLINE,
        evaluate={"max_eval_prompts": 40, "throughput_concurrency": [1, 16], "speedup_rounds": 4},
    )
    write_val_prompts(stage_dir, 40)
    section, _, _ = evaluate.run_online(params)
    assert [c for _, c, _, full in seen if full] == [1, 1]  # full passes at the run's concurrency
    at_1 = [(d, n) for d, c, n, full in seen if c == 1 and not full]
    at_16 = [(d, n) for d, c, n, full in seen if c == 16]
    assert at_1 == [(False, 10), (True, 10), (True, 10), (False, 10)] * 2  # 40 prompts / 4 rounds
    assert at_16 == [(False, 32), (True, 32), (True, 32), (False, 32)] * 2  # two waves of 16
    assert set(section["by_concurrency"]) == {"1", "16"}
    row = section["by_concurrency"]["16"]
    assert row["tokens_per_s"] == 32 * 2 / 0.125 and row["speedup"] == pytest.approx(2.0)
    assert row["speedup_rounds"] == [2.0] * 4 and row["speedup_num_prompts"] == 32
    assert row["mean_acceptance_length"] == pytest.approx(2.0)  # 4 x 4 accepted in 4 x 4 drafts
    assert section["tokens_per_s"] == 10 * 2 / 0.5 and section["speedup"] == pytest.approx(2.0)


def test_a_wide_spread_gives_no_speedup_in_eval_json(
    stage_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The machine slowed down for the drafter's runs in one round: no figure, the rounds'
    ratios, their spread and the reason instead."""
    drafter_runs = iter([1.0] + [0.5, 0.5, 2.0, 0.5, 0.5])  # full pass, then 5 rounds

    def fake(spec: ServerSpec, conversations: list, settings: oe.Settings) -> oe.RunResult:
        if spec.speculative_config:
            return fake_run([[1, 2]] * len(conversations), next(drafter_runs), 4, 4)
        return fake_run([[1, 2]] * len(conversations), 1.0, drafts=0, accepted=0)

    _served_by(monkeypatch, fake)
    section, _, _ = evaluate.run_online(make_params(ONLINE))
    assert section["speedup"] is None and section["speedup_trusted"] is False
    assert section["speedup_rounds"] == [2.0, 2.0, 0.5, 2.0, 2.0]
    assert section["speedup_spread"] == pytest.approx(0.75)
    assert "spread of 0.75 above evaluate.speedup_max_spread=0.25" in section["speedup_note"]


# --- offline: the cap, the device, one read per sample ---------------------------------------


class CopyDrafter:
    """Drafts the sequence's own next tokens: every draft accepted where greedy = the tokens."""

    d2t = None

    def __call__(self, **kw: Any) -> list:
        import torch

        ids = kw["input_ids"][0]
        return [
            torch.cat([ids[1 + k :], torch.full((1 + k,), -1)]).unsqueeze(0)
            for k in range(kw["ttt_steps"])
        ]


def _fake_store(monkeypatch: pytest.MonkeyPatch, n: int) -> tuple[list[str], dict[str, int]]:
    """A store of `n` val samples (and one train) whose hidden states say the next token, a
    verifier head that reads it, and CopyDrafters; (files read, head calls)."""
    import torch

    from eagle3_pipeline.evaluation import offline

    manifest = {"samples": {f"p{i}": {"split": "val", "file": f"p{i}"} for i in range(n)}}
    manifest["samples"]["t0"] = {"split": "train", "file": "t0"}
    ids = torch.arange(12)
    sample = {
        "hidden_states": torch.nn.functional.one_hot(ids.roll(-1), 16)
        .float()[:, None]
        .repeat(1, 4, 1),
        "token_ids": ids,
        "loss_mask": (ids >= 4).long(),
    }
    reads: list[str] = []
    calls = {"greedy": 0}

    class Head:
        def __init__(self, *a: Any) -> None:
            pass

        def greedy(self, final: torch.Tensor) -> torch.Tensor:
            calls["greedy"] += 1
            return final.argmax(-1)

    monkeypatch.setattr(evaluate.vf, "read_config", lambda path: {"num_hidden_layers": 8})
    monkeypatch.setattr(evaluate.store, "read_manifest", lambda root: manifest)
    monkeypatch.setattr(evaluate.store, "check_layout", lambda *a: None)
    monkeypatch.setattr(
        evaluate.store, "read_sample", lambda root, e, **kw: reads.append(e["file"]) or sample
    )
    monkeypatch.setattr(evaluate.drafter, "load_mapping", lambda d: (None, None))
    monkeypatch.setattr(evaluate.drafter, "load_drafter", lambda *a: CopyDrafter())
    monkeypatch.setattr(evaluate.drafter, "fresh_drafter_like", lambda *a: CopyDrafter())
    monkeypatch.setattr(offline, "VerifierHead", Head)
    return reads, calls


def test_offline_cap_is_honoured_and_reported(
    stage_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    n = 6
    reads, calls = _fake_store(monkeypatch, n)
    params = make_params(
        ONLINE, evaluate={"max_offline_samples": 2, "max_eval_prompts": 3, "max_new_tokens": 4}
    )
    simulated, result = evaluate.simulate_offline(params)
    assert result["offline_run"] == {
        "samples_simulated": 2,
        "samples_total": n,
        "max_offline_samples": 2,
        "device": "cpu",
        "dtype": "float32",
    }
    # whole-val: p0, p1; the online run's prompts: p0..p2 (p2 only for the served drafter)
    assert reads == ["p0", "p1", "p2"] and calls["greedy"] == 3
    assert simulated["trained"]["acceptance_rate"] == simulated["untrained"]["acceptance_rate"]
    assert simulated["trained"]["num_drafts"] == 2 * 8  # starts 2..9 of each sample
    same = result["offline_same_prompts"]
    assert same["num_prompts"] == 3 and same["max_new_tokens"] == 4
    # answer 4..7 (max_new_tokens 4): one draft from start 3, positions 5, 6, 7 all accepted
    assert same["num_drafts"] == 3 and same["mean_acceptance_length"] == 4.0


def test_every_branch_is_simulated_with_its_family_s_drafter_and_walk(
    stage_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An EAGLE-3 branch is simulated as `evaluate`'s own drafter is (same loader, same chained
    walk, same figures for the same weights), from its own checkpoint; a parallel family's
    branch through its own loader and one-pass walk."""
    from eagle3_pipeline.evaluation import offline, parallel_offline

    reads, _ = _fake_store(monkeypatch, 4)
    params = make_params(
        ONLINE,
        evaluate={"max_new_tokens": 4},
        families={"e": {"name": "eagle3"}, "d": {"name": "dflash", "block_size": 4}},
    )
    simulated, result = evaluate.simulate_offline(params)
    loaded: list[tuple[str, str | None]] = []

    def load(path: Path, *a: Any, family: str | None = None) -> CopyDrafter:
        loaded.append((str(path), family))
        return CopyDrafter()

    walked: list[int] = []

    def one_pass(model: Any, hs: Any, ids: Any, greedy: Any, num_steps: int) -> Any:
        walked.append(num_steps)
        return offline.draft_matches(model, hs, ids, greedy, num_steps)

    monkeypatch.setattr(evaluate.drafter, "load_drafter", load)
    monkeypatch.setattr(evaluate.drafter, "load_parallel_drafter", load)
    monkeypatch.setitem(parallel_offline.MATCHES, "dflash", one_pass)
    reads.clear()
    branch = evaluate.simulate_family(params, "e", Path("models/families/e/best"), [2, 4, 5])
    assert loaded == [("models/families/e/best", None)] and not walked
    assert branch["offline"] == {"trained": simulated["trained"]}
    assert branch["offline_same_prompts"] == result["offline_same_prompts"]
    assert reads == ["p0", "p1", "p2", "p3"]
    branch = evaluate.simulate_family(params, "d", Path("models/families/d/best"), [1, 3, 7])
    assert loaded[1:] == [("models/families/d/best", "dflash")] and walked
    assert branch["offline"]["trained"] == simulated["trained"]  # same copying drafter


@pytest.mark.parametrize(("served_drafts", "mismatch"), [(8, False), (2, True)])
def test_a_branch_is_checked_against_its_own_simulation(
    stage_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
    served_drafts: int,
    mismatch: bool,
) -> None:
    """`evaluate --family NAME`: every branch (DFlash, P-EAGLE) gets its offline simulation
    beside vLLM's figure and the MISMATCH rule evaluate applies, naming its own checkpoint."""

    def fake(spec: ServerSpec, conversations: list, settings: oe.Settings) -> oe.RunResult:
        if spec.speculative_config:  # 4 drafts of 3 per prompt, `served_drafts` accepted
            return fake_run([[1, 2, 3]] * 3, wall=1.0, drafts=12, accepted=served_drafts * 3)
        return fake_run([[1, 2, 3]] * 3, wall=2.0, drafts=0, accepted=0)

    simulated: list[str] = []

    def simulate(
        params: Params, name: str, drafter_dir: Path, own: list, verifier: object = None
    ) -> dict[str, Any]:
        simulated.append(name)
        same = {"num_drafts": 12, "mean_acceptance_length": 3.0, "num_prompts": 3}
        return {
            "offline": {"trained": {"mean_acceptance_length": 3.1}},
            "offline_same_prompts": same,
        }

    _served_by(monkeypatch, fake)
    monkeypatch.setattr(evaluate, "simulate_family", simulate)
    monkeypatch.setattr(
        evaluate, "_trained_layers", lambda params, verifier, family=None: [2, 4, 5]
    )
    params = make_params(
        ONLINE, families={"df": {"name": "dflash", "block_size": 4}, "pe": {"name": "peagle"}}
    )
    evaluate.run_family(params, "df")
    out = json.loads(Path("metrics/families/df/eval.json").read_text())
    assert simulated == ["df"] and out["offline"]["trained"]["mean_acceptance_length"] == 3.1
    assert out["mismatch_rule"]["compared_with"] == "offline_same_prompts"
    assert out["mismatch"] is mismatch and out["lossless"]["verdict"] == "identical"
    lines = [x for x in capsys.readouterr().out.splitlines() if "MISMATCH" in x]
    assert [("models/families/df/best/config.json" in x) for x in lines] == [True] * mismatch
    evaluate.run_family(params, "pe")
    out = json.loads(Path("metrics/families/pe/eval.json").read_text())
    assert simulated == ["df", "pe"] and out["mismatch"] is mismatch
    assert out["family"] == "peagle" and out["drafting"] == "parallel"
    lines = [x for x in capsys.readouterr().out.splitlines() if "MISMATCH" in x]
    assert [("models/families/pe/best/config.json" in x) for x in lines] == [True] * mismatch


def test_the_stage_writes_no_speedup_when_the_rounds_disagree(
    stage_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """Through the verdict and into eval.json: speedup null, the rounds, spread and reason; the
    log says why, and acceptance and losslessness come from the full passes as before."""
    drafter_runs = iter([1.0] + [0.5, 0.5, 2.0, 0.5, 0.5])  # full pass, then 5 rounds

    def fake(spec: ServerSpec, conversations: list, settings: oe.Settings) -> oe.RunResult:
        if spec.speculative_config:
            return fake_run([[1, 2]] * len(conversations), next(drafter_runs), 4, 4)
        return fake_run([[1, 2]] * len(conversations), 1.0, drafts=0, accepted=0)

    _served_by(monkeypatch, fake)
    params = make_params(ONLINE)
    section, mismatched, verdict = evaluate.run_online(params)
    out = rules.online_verdict(section, 2.0, mismatched, params.evaluate, verdict)
    online = json.loads(json.dumps(out))["online"]
    assert online["speedup"] is None and online["speedup_spread"] == pytest.approx(0.75)
    assert online["speedup_rounds"] == [2.0, 2.0, 0.5, 2.0, 2.0]
    assert online["mean_acceptance_length"] == 2.0 and out["lossless"]["verdict"] == "identical"
    (line,) = [x for x in capsys.readouterr().out.splitlines() if "vLLM: mean" in x]
    assert "no speed-up figure: the 5 paired rounds' ratios range from x0.50 to x2.00" in line


def test_evaluate_serves_with_its_own_vllm_args_when_given(
    stage_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """evaluate.vllm_extra_args replaces vllm.extra_args on both of evaluate's servers (e.g.
    fp32 where generate and extract ran bf16); null keeps vllm.extra_args."""
    started: list[list[str]] = []

    @contextlib.contextmanager
    def servers_up(specs: list[ServerSpec], together: bool):
        started.extend(spec.extra_args for spec in specs)

        def fake(spec: ServerSpec, conversations: list, settings: oe.Settings) -> oe.RunResult:
            drafts = 3 if spec.speculative_config else 0
            return fake_run([[1, 2]] * len(conversations), wall=1.0, drafts=drafts, accepted=2)

        yield fake

    monkeypatch.setattr(oe, "servers_up", servers_up)
    for own, expected in ((["--dtype", "float32"], ["--dtype", "float32"]), (None, None)):
        started.clear()
        params = make_params(
            ONLINE,
            vllm={"extra_args": ["--dtype", "bfloat16"]},
            evaluate={"vllm_extra_args": own},
        )
        evaluate.run_online(params)
        # the drafter's server also returns vLLM's per-answer counts (served.SPEC_METRICS_ARGS)
        own_args = [
            a[: len(a) - 2] if "--per-request-spec-decode-metrics" in a else a for a in started
        ]
        assert started and all(a == (expected or ["--dtype", "bfloat16"]) for a in own_args)
