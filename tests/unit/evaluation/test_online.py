"""evaluation/online.py without vLLM: the two servers' specs, greedy mismatches, the verdict, the
eval.json section, and the servers started and measured in turn with stand-ins."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
from online_runs import fake_run, stepped_run

from eagle3_pipeline.core.errors import ServerError
from eagle3_pipeline.evaluation import held_out, paired, speedup
from eagle3_pipeline.evaluation import online as oe
from eagle3_pipeline.serving.server import ServerSpec

K = 3
SETTINGS = oe.Settings(num_speculative_tokens=K, max_new_tokens=24, concurrency=2)
CONVERSATIONS = [[{"role": "user", "content": f"question q{i}"}] for i in range(6)]


# --- both runs -------------------------------------------------------------------------------


def test_server_specs_differ_only_in_the_drafter(tmp_path: Path) -> None:
    base = ServerSpec(model="v", log_file=tmp_path / "x.log", revision="r1", trust_remote_code=True)
    baseline, spec = oe.server_specs(base, Path("models/drafter"), K, tmp_path / "logs")
    assert baseline.speculative_config is None
    assert spec.speculative_config == {
        "method": "eagle3",
        "model": "models/drafter",
        "num_speculative_tokens": K,
    }
    assert baseline.log_file.name == "vllm-baseline.log" and spec.log_file.name == "vllm-eagle3.log"
    for s in (baseline, spec):
        assert (s.model, s.revision, s.trust_remote_code) == ("v", "r1", True)


def test_each_family_is_served_by_its_own_method(tmp_path: Path) -> None:
    """P-EAGLE: EAGLE-3's method with parallel drafting (else vLLM drafts it chained and drops
    mask_hidden); DFlash: its own method. Never left to vLLM's guess from the folder name."""
    base = ServerSpec(model="v", log_file=tmp_path / "x.log")
    drafter = Path("models/families/p/best")
    _, peagle = oe.server_specs(base, drafter, K, tmp_path, family="peagle")
    assert peagle.speculative_config == {
        "method": "eagle3",
        "model": str(drafter),
        "num_speculative_tokens": K,
        "parallel_drafting": True,
    }
    assert peagle.log_file.name == "vllm-peagle.log"
    assert oe.speculative_config(drafter, 3, "dflash") == {
        "method": "dflash",
        "model": str(drafter),
        "num_speculative_tokens": 3,
    }


def test_mismatched_prompts_compare_ids_else_texts() -> None:
    a = fake_run([[1, 2], [3, 4], [], [7]], wall=1.0, drafts=0, accepted=0)
    b = fake_run([[1, 2], [3, 5], [], [7]], wall=1.0, drafts=0, accepted=0)
    b.texts[2] = "other"  # no token ids on either side: the texts decide
    assert paired.mismatched_prompts(a, b) == [1, 2]


def test_online_section() -> None:
    """Acceptance and output tokens from the full passes; tokens/s and the speed-up from the
    paired rounds (here every round 9 vs 4.5 tokens/s, as the passes were timed)."""
    baseline = fake_run([[1, 2, 3]] * 3, wall=2.0, drafts=0, accepted=0)
    spec = fake_run([[1, 2, 3]] * 3, wall=1.0, drafts=6, accepted=3)
    rounds = paired.Paired(1, 3, [speedup.Round(9, 1.0, 9, 2.0)] * 5)
    section = oe.online_section(baseline, spec, K, {1: rounds}, 1, 0.25)
    assert section["num_prompts"] == 3 and section["num_drafts"] == 6
    assert section["mean_acceptance_length"] == pytest.approx(1.5)
    assert section["output_tokens"] == section["output_tokens_baseline"] == 9
    assert section["tokens_per_s"] == 9 and section["tokens_per_s_baseline"] == 4.5
    assert section["speedup"] == pytest.approx(2.0)
    assert section["speedup_rounds"] == [2.0] * 5 and section["speedup_trusted"] is True
    assert "by_concurrency" not in section


def test_online_section_of_the_full_passes_alone_has_no_speedup() -> None:
    baseline = fake_run([[1, 2, 3]] * 3, wall=2.0, drafts=0, accepted=0)
    spec = fake_run([[1, 2, 3]] * 3, wall=1.0, drafts=6, accepted=3)
    section = oe.online_section(baseline, spec, K)
    assert section["mean_acceptance_length"] == pytest.approx(1.5)
    assert section["speedup"] is None and section["speedup_trusted"] is False
    assert section["tokens_per_s"] is None


def test_spec_run_without_counters_is_an_error(tmp_path: Path) -> None:
    def fake(spec: ServerSpec, conversations: list, settings: oe.Settings) -> oe.RunResult:
        return fake_run([[1]], wall=1.0, drafts=0, accepted=0)

    base = ServerSpec(model="v", log_file=tmp_path / "x.log")
    with pytest.raises(ServerError, match="speculative decoding is off"):
        oe.evaluate(base, "d", CONVERSATIONS[:1], SETTINGS, tmp_path, fake)


def test_evaluate_judges_losslessness_by_prompt_id(tmp_path: Path) -> None:
    def fake(spec: ServerSpec, conversations: list, settings: oe.Settings) -> oe.RunResult:
        tokens = [[1, 2], [3, 4]]
        if spec.speculative_config:
            tokens[1] = [3, 5]  # no logprobs: a difference that cannot be judged a near tie
            return fake_run(tokens, wall=1.0, drafts=2, accepted=2)
        return fake_run(tokens, wall=1.0, drafts=0, accepted=0)

    base = ServerSpec(model="v", log_file=tmp_path / "x.log")
    _, differing, verdict = oe.evaluate(
        base, "d", CONVERSATIONS[:2], SETTINGS, tmp_path, fake, prompt_ids=["a", "b"]
    )
    assert differing == [1]
    assert verdict.outcome == "diverged" and not verdict.passed
    assert [(d.prompt, d.position) for d in verdict.diverged] == [("b", 1)]


def test_public_sets_are_served_and_judged_on_the_same_servers(tmp_path: Path) -> None:
    """Each public set: both servers' full passes, vLLM's per-answer counts (checked against
    its counters), paired rounds at each concurrency, and its divergences in the one verdict."""
    held = held_out.HeldOutSet("he", "pkg: data", ["h0", "h1"], CONVERSATIONS[:2], ["coding"] * 2)
    started: list[tuple[str, int, int]] = []

    def fake(spec: ServerSpec, conversations: list, settings: oe.Settings) -> oe.RunResult:
        public = conversations[0] == CONVERSATIONS[0] and len(conversations) == 2
        started.append((spec.log_file.name, len(conversations), settings.concurrency))
        tokens = [[1, 2, 3, 4, 5], [6, 7, 8, 9]]
        if not spec.speculative_config:
            return fake_run(tokens, wall=2.0, drafts=0, accepted=0)
        if public:
            tokens[1] = [6, 7, 0, 9]  # diverges without logprobs: the verdict must fail
        return stepped_run(tokens, [[3], [1, 0]] if public else [[2], [2]])

    base = ServerSpec(model="v", log_file=tmp_path / "x.log")
    settings = oe.Settings(
        num_speculative_tokens=K, max_new_tokens=24, concurrency=1, throughput_concurrency=(8,)
    )
    section, _, verdict = oe.evaluate(
        base, "d", CONVERSATIONS[2:4], settings, tmp_path, fake, held_out=[held], answer_window=2
    )
    got = section["held_out"]["he"]
    assert got["num_prompts"] == 2 and got["num_drafts"] == 3
    assert got["mean_acceptance_length"] == pytest.approx(1 + 4 / 3)
    assert got["acceptance_per_position"] == pytest.approx([2 / 3, 1 / 3, 1 / 3])
    assert got["counts_match_counters"] is True
    assert [w["tokens"] for w in got["by_answer_position"]] == [[0, 1], [2, 3]]
    assert got["cut"]["count"] == 2 and got["looping"]["count"] == 0
    assert sorted(got["speedup_by_concurrency"]) == ["1", "8"]
    assert got["speedup_by_concurrency"]["1"]["speedup"] == pytest.approx(2.0)
    assert got["lossless"] == "diverged" and got["num_identical"] == 1
    assert section["served"]["mean_acceptance_length"] == pytest.approx(3.0)
    assert verdict.num_prompts == 4 and [d.prompt for d in verdict.diverged] == ["h1"]
    assert {c for _, n, c in started if n <= 2} >= {1, 8}


def test_runs_without_token_ids_cannot_be_judged() -> None:
    a = fake_run([[1, 2]], wall=1.0, drafts=0, accepted=0)
    b = fake_run([[]], wall=1.0, drafts=1, accepted=1)
    b.texts[0] = "text"
    with pytest.raises(ServerError, match="no token_ids"):
        paired.verdict(["p0"], a, b, SETTINGS)


def test_no_prompts_is_an_error(tmp_path: Path) -> None:
    base = ServerSpec(model="v", log_file=tmp_path / "x.log")
    with pytest.raises(ValueError, match="at least one prompt"):
        oe.evaluate(base, "d", [], SETTINGS, tmp_path, lambda *a: pytest.fail("served"))


def test_servers_started_together_are_measured_in_turn(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    events: list[str] = []

    @contextlib.contextmanager
    def serve_many(specs: list[ServerSpec]):
        events.extend(f"start {'eagle3' if s.speculative_config else 'baseline'}" for s in specs)
        yield [f"url-{i}" for i in range(len(specs))]
        events.append("stop all")

    def measure(url: str, conversations: list, settings: oe.Settings) -> oe.RunResult:
        events.append(f"measure {url}")
        if url == "url-1":
            return fake_run([[1, 2]], wall=1.0, drafts=2, accepted=2)
        return fake_run([[1, 2]], wall=2.0, drafts=0, accepted=0)

    monkeypatch.setattr(oe, "serve_many", serve_many)
    monkeypatch.setattr(oe, "measure", measure)
    base = ServerSpec(model="v", log_file=tmp_path / "x.log")
    section, differing, verdict = oe.evaluate(
        base, "d", CONVERSATIONS[:1], SETTINGS, tmp_path, start_together=True
    )
    assert events[:4] == [
        "start baseline",
        "start eagle3",
        "measure url-0",  # the baseline first, the drafter's server idle meanwhile
        "measure url-1",
    ]
    # then the paired rounds, both servers still up, the order swapped every round
    rounds = ["measure url-0", "measure url-1", "measure url-1", "measure url-0"] * 3
    assert events[4:] == rounds[: 2 * SETTINGS.speedup_rounds] + ["stop all"]
    assert section["speedup"] == pytest.approx(2.0) and differing == [] and verdict.passed


def test_servers_started_in_turn_stay_up_for_the_rounds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without start_together the baseline's server is started first and kept up while the
    drafter's starts: the rounds need both."""
    events: list[str] = []

    @contextlib.contextmanager
    def serve(spec: ServerSpec):
        name = "eagle3" if spec.speculative_config else "baseline"
        events.append(f"start {name}")
        yield f"url-{name}"
        events.append(f"stop {name}")

    def measure(url: str, conversations: list, settings: oe.Settings) -> oe.RunResult:
        events.append(f"measure {url}")
        drafts = 2 if url == "url-eagle3" else 0
        return fake_run([[1, 2]], wall=1.0 if drafts else 2.0, drafts=drafts, accepted=drafts)

    monkeypatch.setattr(oe, "serve", serve)
    monkeypatch.setattr(oe, "serve_many", lambda specs: pytest.fail("started together"))
    monkeypatch.setattr(oe, "measure", measure)
    base = ServerSpec(model="v", log_file=tmp_path / "x.log")
    settings = oe.Settings(num_speculative_tokens=K, max_new_tokens=4, speedup_rounds=2)
    section, _, _ = oe.evaluate(base, "d", CONVERSATIONS[:1], settings, tmp_path)
    assert events == [
        "start baseline",
        "start eagle3",
        "measure url-baseline",
        "measure url-eagle3",
        "measure url-baseline",  # round 0: the baseline first
        "measure url-eagle3",
        "measure url-eagle3",  # round 1: the drafter first
        "measure url-baseline",
        "stop eagle3",
        "stop baseline",
    ]
    assert section["speedup"] == pytest.approx(2.0)


def test_no_rounds_serves_one_server_at_a_time_and_gives_no_speedup(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """evaluate.speedup_rounds 0 (a node that holds one verifier): each server up alone for its
    full pass; acceptance and the verdict as ever, no tokens/s and no speed-up figure."""
    events: list[str] = []

    @contextlib.contextmanager
    def serve(spec: ServerSpec):
        name = "eagle3" if spec.speculative_config else "baseline"
        events.append(f"start {name}")
        yield f"url-{name}"
        events.append(f"stop {name}")

    def measure(url: str, conversations: list, settings: oe.Settings) -> oe.RunResult:
        events.append(f"measure {url}")
        drafts = 2 if url == "url-eagle3" else 0
        return fake_run([[1, 2]], wall=1.0 if drafts else 2.0, drafts=drafts, accepted=drafts)

    monkeypatch.setattr(oe, "serve", serve)
    monkeypatch.setattr(oe, "measure", measure)
    base = ServerSpec(model="v", log_file=tmp_path / "x.log")
    settings = oe.replace(SETTINGS, speedup_rounds=0, throughput_concurrency=(8,))
    section, _, verdict = oe.evaluate(base, "d", CONVERSATIONS[:1], settings, tmp_path)
    assert events == [
        "start baseline",
        "measure url-baseline",
        "stop baseline",
        "start eagle3",
        "measure url-eagle3",
        "stop eagle3",
    ]
    assert section["speedup"] is None and section["tokens_per_s"] is None
    assert section["speedup_note"].startswith("no figure: not measured")
    assert section["mean_acceptance_length"] == pytest.approx(1 + 2 / 2) and verdict.passed
    assert "by_concurrency" not in section  # nothing to pair at 8 either


def test_a_multi_turn_set_asks_its_second_turn_after_the_baseline_answer(tmp_path: Path) -> None:
    """MT-Bench's shape: each prompt's second turn goes to both servers after the baseline's
    first answer; both turns' answers count (by_turn apart), and losslessness is judged per
    answer, so two prompts give four answers to compare."""
    later = [["And in French?"], ["Shorter, please."]]
    held = held_out.HeldOutSet(
        "mt", "pkg: data", ["m0", "m1"], CONVERSATIONS[:2], ["writing"] * 2, later_turns=later
    )
    asked: list[list] = []

    def fake(spec: ServerSpec, conversations: list, settings: oe.Settings) -> oe.RunResult:
        if conversations[0][0] == CONVERSATIONS[0][0] and settings.top_logprobs:
            asked.append(conversations)
        tokens = [[1, 2, 3, 4]] * len(conversations)
        if not spec.speculative_config:
            return fake_run(tokens, wall=2.0, drafts=0, accepted=0)
        second = len(conversations[0]) > 1
        return stepped_run(tokens, [[1] if second else [3]] * len(conversations))

    base = ServerSpec(model="v", log_file=tmp_path / "x.log")
    section, _, verdict = oe.evaluate(
        base, "d", CONVERSATIONS[2:4], SETTINGS, tmp_path, fake, held_out=[held], answer_window=2
    )
    got = section["held_out"]["mt"]
    turn_two = [c for c in asked if len(c[0]) == 3]
    assert turn_two and turn_two[0][0][1] == {"role": "assistant", "content": "[1, 2, 3, 4]"}
    assert [c[0][2]["content"] for c in turn_two[:1]] == ["And in French?"]
    assert got["num_prompts"] == 2 and got["num_answers"] == 4 and got["num_identical"] == 4
    assert [t["mean_acceptance_length"] for t in got["by_turn"]] == pytest.approx([4.0, 2.0])
    assert got["mean_acceptance_length"] == pytest.approx(3.0)
    assert verdict.num_prompts == 6  # two val prompts, four answers of the set
