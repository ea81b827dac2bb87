"""`make dag`: dvc.yaml's pipeline on one page, each stage in order with the stages it reads from.

`dvc dag` draws the graph the current params.yaml resolves (a `foreach` stage once per entry, none
for an empty list) and grows wider than a terminal; this reads dvc.yaml itself, so every stage
shows once, `foreach` ones as `name@KEY`, one line each, within 100 columns. A stage reads from
another when one of its deps is, holds or lies under one of that stage's outputs.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
WIDTH = 100


def _paths(entries: list[Any]) -> list[str]:
    """The paths of a deps/outs/metrics/plots list (an entry may be `{path: {options}}`)."""
    return [e if isinstance(e, str) else next(iter(e)) for e in entries]


def _pattern(path: str) -> re.Pattern[str]:
    """A templated path (`metrics/fractions/${item}/eval.json`) as a regex of its branches."""
    parts = re.split(r"\$\{[^}]+\}", path.rstrip("/"))
    return re.compile("[^/]+".join(map(re.escape, parts)))


def _related(dep: str, out: str) -> bool:
    """dep is, holds or lies under out (either may name a foreach branch)."""
    if re.search(r"\$\{(?!key\}|item\})", dep):
        return False  # a params value (`${prepare.prompts}`): the user's files
    d, o = _pattern(dep), _pattern(out)
    dep_plain = re.sub(r"\$\{[^}]+\}", "X", dep.rstrip("/"))
    out_plain = re.sub(r"\$\{[^}]+\}", "X", out.rstrip("/"))
    return bool(
        o.fullmatch(dep_plain)
        or d.fullmatch(out_plain)
        or re.match(o.pattern + "/", dep_plain)
        or re.match(d.pattern + "/", out_plain)
    )


def lines(dvc_yaml: str) -> list[str]:
    stages: dict[str, dict[str, Any]] = yaml.safe_load(dvc_yaml)["stages"]
    names, outs, deps = [], {}, {}
    for name, stage in stages.items():
        body = stage.get("do", stage)
        key = {"${curve.fractions}": "F"}.get(stage.get("foreach", ""), "NAME")
        label = f"{name}@{key}" if "foreach" in stage else name
        names.append(label)
        outs[label] = _paths(body.get("outs", []) + body.get("metrics", []) + body.get("plots", []))
        deps[label] = [d for d in _paths(body.get("deps", [])) if "${pkg}" not in d]
    width = max(map(len, names))
    out = [f"{'stage':<{width}}  <- reads from (dvc.yaml order; `dvc dag` for this params.yaml)"]
    for label in names:
        upstream = [
            other
            for other in names
            if other != label and any(_related(d, o) for d in deps[label] for o in outs[other])
        ]
        text = f"{label:<{width}}  <- {', '.join(upstream) or 'no stage'}"
        out.append(text if len(text) <= WIDTH else text[: WIDTH - 3] + "...")
    return out


def main() -> int:
    print("\n".join(lines((REPO / "dvc.yaml").read_text())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
