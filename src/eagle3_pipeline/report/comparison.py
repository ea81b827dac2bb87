"""The drafters of one run side by side: `train`'s and each `families` branch's, measured alike.

`make train` prints it last, so a families profile ends with the comparison its user came for:
simulated and served acceptance at the same number of draft tokens, the speedup with and at the
best draft count, losslessness, and whether each drafter learned (untrained -> trained). Each
speedup is the median of paired rounds against a baseline timed beside that drafter; where the
rounds spread too wide the cell says "none (spread S)" instead of a figure (evaluation/speedup.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eagle3_pipeline.config.families import Families, FamilyParams
from eagle3_pipeline.core import paths, readers
from eagle3_pipeline.core.errors import DataError
from eagle3_pipeline.evaluation import speedup

HEAD = (
    "drafter",
    "family",
    "drafting",
    "offline",
    "vLLM",
    "tokens/s with/without",
    "speedup",
    "best",
    "lossless",
    "untrained -> trained",
)


def _read(path: Path, stage: str) -> dict[str, Any]:
    """`stage`'s metrics file, or {} when it has not run; a broken one: one-line DataError."""
    fix = f"rerun the stage: dvc repro --force --single-item {stage}"
    return readers.read_json_object(path, DataError, fix) if path.is_file() else {}


def number(x: Any, spec: str) -> str:
    """A metric as both drafter tables show it (this one and the report's): "-" when absent."""
    return format(x, spec) if isinstance(x, (int, float)) else "-"


def _row(name: str, family: str, drafting: str, ev: dict[str, Any], learned: str) -> list[str]:
    online = ev.get("online") or {}
    with_and_without = [online.get("tokens_per_s"), online.get("tokens_per_s_baseline")]
    return [
        name,
        family,
        drafting,
        number((ev.get("offline") or {}).get("trained", {}).get("mean_acceptance_length"), ".3f"),
        number(online.get("mean_acceptance_length"), ".3f"),
        "/".join(number(x, ".1f") for x in with_and_without),
        speedup.cell(online) if online else "-",
        _best(online),
        (ev.get("lossless") or {}).get("verdict", "-") if online else "-",
        learned,
    ]


def _best(online: dict[str, Any]) -> str:
    """The draft count with the highest speedup and that speedup; "none" when the counts were
    swept but none has a figure."""
    swept = online.get("by_num_speculative_tokens") or {}
    best = online.get("best_num_speculative_tokens")
    if best is None:
        return "none" if swept else "-"
    at_best = swept.get(str(best)) or {}
    return f"{best}: {speedup.cell(at_best)}" if at_best else "-"


def _train_learned(ev: dict[str, Any]) -> str:
    """The simulated acceptance of the untrained drafter, then of the trained one."""
    offline = ev.get("offline") or {}
    before = (offline.get("untrained") or {}).get("mean_acceptance_length")
    after = (offline.get("trained") or {}).get("mean_acceptance_length")
    return f"{number(before, '.3f')} -> {number(after, '.3f')} offline"


def _branch_learned(train: dict[str, Any]) -> str:
    """Val accuracy at draft position 1 of the untrained twin, then of the trained branch."""
    drafter = train.get("drafter") or {}
    twin = (drafter.get("untrained_twin") or {}).get("val_accuracy_by_position") or {}
    trained = drafter.get("val_accuracy_by_position") or {}
    if not twin:
        return "-"
    return f"{number(twin.get('1'), '.3f')} -> {number(trained.get('1'), '.3f')} val acc@1"


def rows(
    train_family: FamilyParams, families: Families, metrics: Path = paths.METRICS
) -> list[list[str]]:
    """One row for `train`'s drafter (of `train_family`), then one per `families` entry that
    has been evaluated."""
    found = []
    if ev := _read(metrics / "eval.json", "evaluate"):
        t = train_family
        found.append(_row("train", t.name, t.drafting, ev, _train_learned(ev)))
    for name, family in families.items():
        if ev := _read(metrics / "families" / name / "eval.json", f"family_eval@{name}"):
            learned = _branch_learned(
                _read(metrics / "families" / name / "train.json", f"family@{name}")
            )
            found.append(_row(name, family.name, family.drafting, ev, learned))
    return found


def table(body: list[list[str]]) -> str:
    """`body` under HEAD, columns aligned for a terminal or a log file."""
    widths = [max(len(r[i]) for r in [list(HEAD), *body]) for i in range(len(HEAD))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip()
        for r in [list(HEAD), *body]
    )
