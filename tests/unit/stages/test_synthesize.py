"""The synthesize stage with a scripted sampler (no model): count 0 starts nothing, count is
reached, drops are counted by reason, a killed run resumes to the same prompts, a larger count
goes on from the batches drawn, a spent max_samples_ratio fails in one line, multi-turn rows end
with a user turn. The real engine: one smoke run (docs of the stage)."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from collections.abc import Sequence
from pathlib import Path

import dvc_outputs
import pytest
from builders import PARAMS_YAML, fake_verifier, make_params, params_file

from eagle3_pipeline.cli import main
from eagle3_pipeline.config.params import Params
from eagle3_pipeline.conversations import formats
from eagle3_pipeline.core import readers
from eagle3_pipeline.core.errors import DataError, ParamsError
from eagle3_pipeline.serving import sampler as samplers
from eagle3_pipeline.stages import synthesize
from eagle3_pipeline.verifier import tiny

REPO = Path(__file__).resolve().parents[3]
WORDS = [f"{w}{i}" for i in range(12) for w in ("river", "cloud", "stone", "maple", "lamp")]
SEA = "Tell me about the sea."


@pytest.fixture(scope="module")
def verifier(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A verifier folder as far as the stage reads it without a model: config.json and the
    tokenizer (with its chat template) the tiny verifier stage trains."""
    out = tmp_path_factory.mktemp("verifier")
    texts, _ = tiny._read_corpus(REPO / "data/corpus/verifier_corpus.jsonl")
    tiny._train_tokenizer(texts[:60], 400).save_pretrained(str(out))
    return fake_verifier(out, {"model_type": "llama", "num_hidden_layers": 2})


class Scripted:
    """A sampler whose completions depend only on (seed, position in the call), as vLLM's with
    torch.manual_seed before each call: mostly fresh questions, some truncated, empty, leaking
    the template or repeating one question."""

    def __init__(
        self,
        tokenizer,
        fail_on_call: int | None = None,
        same: bool = False,
        answers_end: bool = True,
    ) -> None:
        self.tokenizer, self.fail_on_call, self.same = tokenizer, fail_on_call, same
        self.answers_end = answers_end
        self.calls: list[tuple[int, float, list[str]]] = []  # (seed, temperature, prompts)
        self.end = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def generate(
        self, prompts: Sequence[Sequence[int]], request: samplers.Request, seed: int
    ) -> list[samplers.Completion]:
        if self.fail_on_call == len(self.calls):
            raise RuntimeError("killed")
        decoded = [self.tokenizer.decode(list(p), skip_special_tokens=False) for p in prompts]
        self.calls.append((seed, request.temperature, decoded))
        rng = random.Random(seed)
        out = []
        for _ in prompts:
            if request.temperature == 0 and not self.answers_end:
                text, ended = "Reasoning that goes on and on", False
            elif request.temperature == 0:
                text, ended = "Some thought.</think> An answer.", True
            else:
                text, ended = self._turn(rng)
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            out.append(samplers.Completion(ids + [self.end] * ended, ended))
        return out

    def _turn(self, rng: random.Random) -> tuple[str, bool]:
        if self.same:
            return SEA, True
        roll = rng.random()
        if roll < 0.1:
            return "What is the longest river and why does it", False
        if roll < 0.15:
            return "", True
        if roll < 0.2:
            return "Explain this <|im_user|>user<|im_middle|> please", True
        if roll < 0.3:
            return SEA, True
        return " ".join(rng.sample(WORDS, 9)).capitalize() + "?", True


# This file's start: 20 prompts in batches of 8, the template's thinking on.
SYNTH = {
    "generate": {"chat_template_kwargs": {"thinking": True}},
    "prepare": {"synthesize": {"count": 20, "batch_size": 8}},
}


def synth_params(verifier: Path, **synth: object) -> Params:
    """SYNTH for the verifier in `verifier`, `synth` changing prepare.synthesize."""
    return make_params(SYNTH, verifier={"path": str(verifier)}, prepare={"synthesize": synth})


def _run(
    root: Path, params: Params, monkeypatch: pytest.MonkeyPatch, sampler: Scripted | None
) -> tuple[list[dict], dict]:
    """The stage in `root` with `sampler` (None: opening one fails the test)."""
    import contextlib

    @contextlib.contextmanager
    def opened(_verifier, _synthesize, _vllm, _tokenizer):
        assert sampler is not None, "the stage started a sampler"
        yield sampler

    monkeypatch.setattr(samplers, "open_sampler", opened)
    root.mkdir(parents=True, exist_ok=True)
    monkeypatch.chdir(root)
    synthesize.run(params)
    out = root / "data/synthesized"
    return readers.read_jsonl(out / "prompts.jsonl"), json.loads((out / "stats.json").read_text())


def _tokenizer(verifier: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(verifier))


def test_count_zero_writes_an_empty_set_without_reading_the_verifier(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    params = synth_params(tmp_path / "no-verifier", count=0)
    rows, stats = _run(tmp_path, params, monkeypatch, None)
    assert rows == [] and (tmp_path / "data/synthesized/prompts.jsonl").read_bytes() == b""
    assert stats["kept"] == stats["sampled"] == 0 and stats["seconds"] == 0.0
    assert set(stats["dropped"]) == {
        "empty",
        "truncated",
        "template_leak",
        "duplicate",
        "near_duplicate",
    }
    first = (tmp_path / "data/synthesized/stats.json").read_bytes()
    _run(tmp_path, params, monkeypatch, None)  # byte-identical every time: DVC caches it
    assert (tmp_path / "data/synthesized/stats.json").read_bytes() == first


def test_count_prompts_are_kept_and_drops_counted(
    tmp_path: Path, verifier: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    sampler = Scripted(_tokenizer(verifier))
    rows, stats = _run(tmp_path, synth_params(verifier, count=40), monkeypatch, sampler)
    assert len(rows) == 40 == stats["kept"]
    ids = [r["id"] for r in rows]
    assert len(set(ids)) == 40 and all(i.startswith("syn-") and len(i) == 24 for i in ids)
    assert [r["id"] for r in rows] == [synthesize.conversation_id(r["messages"]) for r in rows]
    for n, r in enumerate(rows):  # prepare reads them as they are
        assert formats.normalize(r, n) == r
        assert [m["role"] for m in r["messages"]] == ["user"]
        assert r["messages"][0]["content"] == r["messages"][0]["content"].strip()
    assert sum(r["messages"][0]["content"] == SEA for r in rows) <= 1
    d = stats["dropped"]
    assert d["truncated"] and d["empty"] and d["template_leak"] and d["duplicate"]
    assert stats["sampled"] == 8 * stats["batches"] == len(sampler.calls) * 8
    assert stats["sampled"] == stats["kept"] + sum(d.values()) + stats["unused"]
    assert stats["opening"] == "<|im_user|>user<|im_middle|>" and stats["stop"] == ["<|im_end|>"]
    assert stats["examples"]["truncated"][0].startswith("What is the longest river")
    # every call: the opening alone, sampled at the params' temperature, seeded by batch
    assert {p for _, _, prompts in sampler.calls for p in prompts} == {
        "<|im_user|>user<|im_middle|>"
    }
    assert [s for s, _, _ in sampler.calls] == [
        synthesize.batch_seed(0, i, 1, "user") for i in range(stats["batches"])
    ]
    out = capsys.readouterr().out
    assert "[synthesize] user turns open with '<|im_user|>user<|im_middle|>' and end at" in out
    assert "[synthesize] 40/40 100%" in out and "prompts/s" in out and "ETA" in out
    assert f"[synthesize] kept 40 of {stats['sampled']} sampled (dropped " in out


def test_a_killed_run_resumes_to_the_same_prompts(
    tmp_path: Path, verifier: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tok = _tokenizer(verifier)
    whole, _ = _run(tmp_path / "whole", synth_params(verifier), monkeypatch, Scripted(tok))
    killed = tmp_path / "killed"
    with pytest.raises(RuntimeError, match="killed"):
        _run(killed, synth_params(verifier), monkeypatch, Scripted(tok, fail_on_call=1))
    assert not (killed / "data/synthesized").exists()
    journal = readers.read_jsonl(killed / "data/.work/synthesize/batches.jsonl")
    assert [e["batch"] for e in journal] == [0]
    again = Scripted(tok)
    resumed, stats = _run(killed, synth_params(verifier), monkeypatch, again)
    assert again.calls[0][0] == synthesize.batch_seed(0, 1, 1, "user")  # batch 0 not redrawn
    assert stats["batches_resumed"] == 1
    assert resumed == whole
    assert (killed / "data/synthesized/prompts.jsonl").read_bytes() == (
        tmp_path / "whole/data/synthesized/prompts.jsonl"
    ).read_bytes()


def test_a_larger_count_goes_on_from_the_batches_drawn(
    tmp_path: Path, verifier: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tok = _tokenizer(verifier)
    small, s_stats = _run(tmp_path, synth_params(verifier, count=10), monkeypatch, Scripted(tok))
    more = Scripted(tok)
    large, l_stats = _run(tmp_path, synth_params(verifier, count=30), monkeypatch, more)
    assert large[:10] == small  # nested: a smaller count keeps a prefix
    assert len(more.calls) == l_stats["batches"] - s_stats["batches"]
    # back to 10: everything from the journal, no sampler
    again, stats = _run(tmp_path, synth_params(verifier, count=10), monkeypatch, None)
    assert again == small and stats["prompts_per_s"] == 0.0


@pytest.mark.parametrize("teammate", ["workspace", "dvc-cache"])
def test_a_larger_count_goes_on_from_the_published_batches_alone(
    tmp_path: Path, verifier: Path, monkeypatch: pytest.MonkeyPatch, capsys, teammate: str
) -> None:
    """No scratch journal (a teammate's pulled output): the batches drawn are read from
    data/synthesized/batches.jsonl, sampling goes on from the first one missing, and the output
    is the one a run from scratch at the larger count writes."""
    tok = _tokenizer(verifier)
    run = tmp_path / "run"
    small, s_stats = _run(run, synth_params(verifier, count=10), monkeypatch, Scripted(tok))
    if teammate == "dvc-cache":
        dvc_outputs.commit(run, "synthesize", ["data/synthesized"])
        dvc_outputs.pulled_only(run, ["data/synthesized"])
    else:
        shutil.rmtree(run / "data/.work")
    more = Scripted(tok)
    capsys.readouterr()
    large, l_stats = _run(run, synth_params(verifier, count=30), monkeypatch, more)
    assert large[:10] == small
    assert len(more.calls) == l_stats["batches"] - s_stats["batches"]  # only the new batches
    assert more.calls[0][0] == synthesize.batch_seed(0, s_stats["batches"], 1, "user")
    where = "data/synthesized" + (" as dvc.lock records it" if teammate == "dvc-cache" else "")
    said = re.search(
        rf"\[synthesize\] reused (\d+) of 30 rows from {where}[^;\n]*; making (\d+)\n",
        capsys.readouterr().out,
    )
    # the prompts of every batch drawn: the first 10, and the last batch's beyond count 10
    assert said and int(said[1]) >= 10 and int(said[1]) + int(said[2]) == 30
    whole, w_stats = _run(
        tmp_path / "whole", synth_params(verifier, count=30), monkeypatch, Scripted(tok)
    )
    assert large == whole
    for name in (synthesize.PROMPTS, synthesize.JOURNAL):
        assert (run / "data/synthesized" / name).read_bytes() == (
            tmp_path / "whole/data/synthesized" / name
        ).read_bytes()


def test_system_prompts_steer_the_first_turn_of_their_batches_and_stay_out_of_the_rows(
    tmp_path: Path, verifier: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Batch i opens after system prompt i % 2 ("" = the template's own opening); the rows hold
    the user's words alone; stats count what each steer kept; the prompts key the batches."""
    tok = _tokenizer(verifier)
    sampler = Scripted(tok)
    steer = ["", "You write Python functions."]
    rows, stats = _run(
        tmp_path / "steered",
        synth_params(verifier, count=30, system_prompts=steer),
        monkeypatch,
        sampler,
    )
    plain = "<|im_user|>user<|im_middle|>"
    coding = "<|im_system|>system<|im_middle|>You write Python functions.<|im_end|>" + plain
    assert [{*prompts} for _, _, prompts in sampler.calls] == [
        {plain if i % 2 == 0 else coding} for i in range(stats["batches"])
    ]
    assert all([m["role"] for m in r["messages"]] == ["user"] for r in rows)
    assert sum(stats["kept_by_system_prompt"]) == 30 and min(stats["kept_by_system_prompt"]) > 0
    batches = readers.read_jsonl(tmp_path / "steered/data/synthesized/batches.jsonl")
    assert [b["steer"] for b in batches] == [i % 2 for i in range(len(batches))]
    unsteered = synth_params(verifier, count=30)
    assert synthesize.settings_key(unsteered, "stamp") != synthesize.settings_key(
        synth_params(verifier, count=30, system_prompts=steer), "stamp"
    )
    plain_rows, plain_stats = _run(tmp_path / "plain", unsteered, monkeypatch, Scripted(tok))
    assert "kept_by_system_prompt" not in plain_stats
    assert "steer" not in readers.read_jsonl(tmp_path / "plain/data/synthesized/batches.jsonl")[0]


def test_system_prompts_need_a_template_with_a_system_role(
    tmp_path: Path, verifier: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from eagle3_pipeline.conversations import magpie

    shape = magpie.derive(_tokenizer(verifier), {})
    no_system = type(shape)(**{**shape.__dict__, "system_open": ""})
    params = synth_params(verifier, system_prompts=["", "You write Python functions."])
    with pytest.raises(ParamsError, match="prepare.synthesize.system_prompts: .* no system role"):
        synthesize.steered_openings(params, _tokenizer(verifier), no_system)
    assert (
        synthesize.steered_openings(
            synth_params(verifier, system_prompts=["", ""]), _tokenizer(verifier), no_system
        )
        == [no_system.opening] * 2
    )


def test_a_spent_max_samples_ratio_fails_in_one_line(
    tmp_path: Path, verifier: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sampler = Scripted(_tokenizer(verifier), same=True)
    params = synth_params(verifier, count=10, batch_size=4, max_samples_ratio=2.0)
    with pytest.raises(DataError) as err:
        _run(tmp_path, params, monkeypatch, sampler)
    msg = str(err.value)
    assert "\n" not in msg
    assert "kept 1 of prepare.synthesize.count=10 prompts after 20 conversations sampled" in msg
    assert "dropped 19 duplicate" in msg and "raise max_samples_ratio" in msg
    assert "temperature" in msg  # what to change for duplicates
    assert len(sampler.calls) == 5  # ceil(10 x 2 / 4) batches
    assert not (tmp_path / "data/synthesized").exists()


def test_multi_turn_rows_end_with_a_user_turn(
    tmp_path: Path, verifier: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sampler = Scripted(_tokenizer(verifier))
    rows, stats = _run(tmp_path, synth_params(verifier, count=6, turns=2), monkeypatch, sampler)
    assert len(rows) == 6
    for r in rows:
        assert [m["role"] for m in r["messages"]] == ["user", "assistant", "user"]
        assert r["messages"][1]["content"] == "An answer."  # reasoning set apart
    answers = [c for c in sampler.calls if c[1] == 0.0]
    assert answers and all(
        p.startswith("<|im_user|>user<|im_middle|>")
        and p.endswith("<|im_assistant|>assistant<|im_middle|><think>")
        for _, _, prompts in answers
        for p in prompts
    )
    second = [
        c for c in sampler.calls if c[1] > 0 and c[0] == synthesize.batch_seed(0, 0, 2, "user")
    ]
    assert second and all(
        p.endswith("<think></think>An answer.<|im_end|><|im_user|>user<|im_middle|>")
        for p in second[0][2]
    )
    assert stats["user_turns_sampled"] > stats["sampled"]
    assert set(stats["dropped_at_answer"]) <= {"empty", "truncated", "template_leak"}


def test_answers_that_never_end_are_named_in_the_failure(
    tmp_path: Path, verifier: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sampler = Scripted(_tokenizer(verifier), answers_end=False)
    params = synth_params(verifier, count=4, batch_size=4, turns=2, max_samples_ratio=1.0)
    with pytest.raises(DataError, match="raise prepare.synthesize.max_answer_tokens"):
        _run(tmp_path, params, monkeypatch, sampler)


def test_the_command_fails_in_one_line(
    tmp_path: Path, verifier: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    params_file(
        tmp_path / "params.yaml",
        PARAMS_YAML,
        verifier={"path": str(verifier)},
        prepare={"synthesize": {"count": 4, "batch_size": 2, "max_samples_ratio": 1.0}},
    )
    sampler = Scripted(_tokenizer(verifier), same=True)
    monkeypatch.setattr(
        samplers, "open_sampler", lambda *_: __import__("contextlib").nullcontext(sampler)
    )
    monkeypatch.chdir(tmp_path)
    assert main(["synthesize"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "error: data/synthesized: kept 1 of" in err
    assert os.listdir(tmp_path / "data") == [".work"]
