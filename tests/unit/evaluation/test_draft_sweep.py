"""evaluate.num_speculative_tokens_sweep without vLLM: the drafter served again at each further
count (its own server and log, the same baseline, paired rounds against it), each count's row
beside the simulated walk at that count, and the best count by its speed-up."""

from __future__ import annotations

from pathlib import Path

import pytest
from online_runs import fake_run

from eagle3_pipeline.config.params import EvaluateParams, Params
from eagle3_pipeline.evaluation import draft_sweep
from eagle3_pipeline.evaluation import online as oe
from eagle3_pipeline.evaluation.offline import AcceptanceCounts, Simulation
from eagle3_pipeline.serving.server import ServerSpec

SETTINGS = oe.Settings(num_speculative_tokens=3, max_new_tokens=24, throughput_concurrency=(2,))
PROMPTS = [[{"role": "user", "content": "q"}]]


def test_each_count_is_served_on_its_own_server_and_the_best_is_the_fastest(
    tmp_path: Path,
) -> None:
    served: list[tuple[int | None, str, tuple[int, ...]]] = []
    walls = {None: 2.0, 3: 1.0, 1: 1.6, 5: 0.8}  # tokens/s: 2 without, 4, 2.5, 5

    rounds: list[tuple[int | None, int]] = []

    def runner(spec: ServerSpec, conversations: list, settings: oe.Settings) -> oe.RunResult:
        k = (spec.speculative_config or {}).get("num_speculative_tokens")
        if settings.top_logprobs:  # a full pass (the rounds ask no logprobs)
            served.append((k, spec.log_file.name, settings.throughput_concurrency))
        else:
            rounds.append((k, settings.concurrency))
        assert k is None or settings.num_speculative_tokens == k  # counters read at k positions
        tokens = [[1, 2, 3, 4]] if k != 5 else [[1, 2, 3, 9]]  # 5 drafts: output differs
        return fake_run(tokens, walls[k], drafts=2 if k else 0, accepted=k or 0, k=k or 3)

    base = ServerSpec(model="v", log_file=tmp_path / "x.log")
    section, _, verdict = oe.evaluate(
        base, "d", PROMPTS, SETTINGS, tmp_path, runner, family="peagle", sweep=[1, 3, 5]
    )
    assert served == [
        (None, "vllm-baseline.log", (2,)),
        (3, "vllm-peagle.log", (2,)),
        (1, "vllm-peagle-k1.log", ()),  # a further count: timed at the run's concurrency only
        (5, "vllm-peagle-k5.log", ()),
    ]
    by = section["by_num_speculative_tokens"]
    assert list(by) == ["1", "3", "5"] and section["best_num_speculative_tokens"] == 5
    assert by["3"]["tokens_per_s"] == section["tokens_per_s"] == 4.0
    assert by["1"]["speedup"] == pytest.approx(1.25) and by["5"]["speedup"] == pytest.approx(2.5)
    assert by["1"]["mean_acceptance_length"] == 1.5 and by["5"]["mean_acceptance_length"] == 3.5
    assert by["3"]["greedy_outputs_identical"] and not by["5"]["greedy_outputs_identical"]
    assert verdict.passed  # the verdict is the common count's run
    # every count timed against the baseline in its own rounds, the order swapped each round
    pair = [(None, 1), (3, 1), (3, 1), (None, 1), (None, 1)]
    assert rounds[:5] == pair  # the common count at the run's concurrency, then at 2
    assert rounds[20:25] == [(None, 1), (1, 1), (1, 1), (None, 1), (None, 1)]
    assert rounds[30:35] == [(None, 1), (5, 1), (5, 1), (None, 1), (None, 1)]
    assert len(rounds) == 4 * 2 * SETTINGS.speedup_rounds
    assert by["5"]["speedup_rounds"] == [2.5] * 5 and by["5"]["speedup_trusted"]


def test_a_count_without_a_trusted_speedup_cannot_be_the_best(tmp_path: Path) -> None:
    """The fastest count's rounds disagree: it has no figure, and the best is another count."""
    fives = iter([0.8] + [0.8, 0.8, 0.4, 0.8, 0.8])  # its full pass, then 5 rounds

    def runner(spec: ServerSpec, conversations: list, settings: oe.Settings) -> oe.RunResult:
        k = (spec.speculative_config or {}).get("num_speculative_tokens")
        wall = {None: 2.0, 3: 1.0}.get(k) or next(fives)
        return fake_run([[1, 2, 3, 4]], wall, drafts=2 if k else 0, accepted=k or 0, k=k or 3)

    base = ServerSpec(model="v", log_file=tmp_path / "x.log")
    settings = oe.replace(SETTINGS, throughput_concurrency=())
    section, _, _ = oe.evaluate(base, "d", PROMPTS, settings, tmp_path, runner, sweep=[3, 5])
    by = section["by_num_speculative_tokens"]
    assert by["5"]["speedup"] is None and by["5"]["speedup_spread"] == pytest.approx(1.0)
    assert section["best_num_speculative_tokens"] == 3 and by["3"]["speedup"] == 2.0


def test_no_sweep_no_keys(tmp_path: Path) -> None:
    def runner(spec: ServerSpec, conversations: list, settings: oe.Settings) -> oe.RunResult:
        return fake_run([[1]], 1.0, drafts=1 if spec.speculative_config else 0, accepted=1)

    base = ServerSpec(model="v", log_file=tmp_path / "x.log")
    section, _, _ = oe.evaluate(base, "d", PROMPTS, SETTINGS, tmp_path, runner, sweep=[3])
    assert "by_num_speculative_tokens" not in section  # the common count alone: nothing swept


def _counts(k: int, drafts: int, accepted: int) -> AcceptanceCounts:
    c = AcceptanceCounts(k, drafts=drafts)
    c.accepted_per_pos = [accepted] + [0] * (k - 1)
    return c


def test_each_row_gets_the_simulated_walk_at_its_count() -> None:
    sim = Simulation({}, _counts(3, 10, 15), 4, 2, {1: _counts(1, 20, 8)})
    same = draft_sweep.same_prompts(sim, EvaluateParams(max_new_tokens=24))
    assert same["mean_acceptance_length"] == 2.5 and same["num_prompts"] == 2
    assert same["by_num_speculative_tokens"] == {"1": 1.4}
    online = {"by_num_speculative_tokens": {"1": {"tokens_per_s": 1.0}, "3": {}, "5": {}}}
    rows = draft_sweep.with_simulated(online, same, 3)["by_num_speculative_tokens"]
    key = "offline_same_prompts_mean_acceptance_length"
    assert rows["1"][key] == 1.4 and rows["3"][key] == 2.5 and key not in rows["5"]
    assert draft_sweep.with_simulated({"speedup": 1.0}, same, 3) == {"speedup": 1.0}


def test_a_count_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="num_speculative_tokens_sweep"):
        Params.model_validate({"evaluate": {"num_speculative_tokens_sweep": [2, 0]}})
