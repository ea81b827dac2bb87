"""The params keys dvc.yaml's stages read, held against a params file as written.

The schema (params.py) fills every key a file leaves out; DVC does not. `foreach: ${families}`
and `${curve.fractions}` fail to parse dvc.yaml at all without their key, and a stage whose
`params:` lists a key the file lacks fails when DVC reaches it, after the stages before it ran.
So `eagle3 plan` and the `check` stage compare the raw YAML with dvc.yaml and name every
missing key in one line, with the value the schema would give it.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from eagle3_pipeline.core.errors import ParamsError

DVC_YAML = Path("dvc.yaml")
PARAMS_FILE = "params.yaml"  # the file DVC reads params and ${...} values from by default
_INTERPOLATION = re.compile(r"\$\{\s*([^}\s]+)\s*\}")
_LOOP_VARIABLES = {"item", "key"}  # foreach's own names


def _strings(node: Any) -> list[str]:
    """Every string value in a parsed YAML tree (comments are gone already)."""
    if isinstance(node, str):
        return [node]
    if isinstance(node, dict):
        return [s for k, v in node.items() for s in _strings(k) + _strings(v)]
    if isinstance(node, list):
        return [s for v in node for s in _strings(v)]
    return []


def _listed(stage: dict[str, Any]) -> list[str]:
    """The keys in a stage's `params:` (a foreach stage's under `do`) read from params.yaml."""
    body = stage.get("do", stage)
    keys: list[str] = []
    for entry in body.get("params") or []:
        if isinstance(entry, str):
            keys.append(entry)
        elif isinstance(entry, dict):  # {file: [keys]}: only params.yaml's are ours
            keys += [k for k in entry.get(PARAMS_FILE) or [] if isinstance(k, str)]
    return keys


def dvc_params_keys(dvc_text: str) -> list[str]:
    """Every params key dvc.yaml needs: those its stages list, and those it interpolates
    (`${families}`, `${curve.fractions}`, `${prepare.prompts}`); a templated key such as
    `families.${key}` needs its fixed part (`families`)."""
    doc = yaml.safe_load(dvc_text) or {}
    local = set(_LOOP_VARIABLES)
    for entry in doc.get("vars") or []:
        if isinstance(entry, dict):  # a file name entry loads that file's keys: not ours
            local |= set(entry)
    stages = doc.get("stages") or {}
    keys = {k for stage in stages.values() if isinstance(stage, dict) for k in _listed(stage)}
    keys |= {
        name
        for text in _strings(stages)
        for name in _INTERPOLATION.findall(text)
        if name.split(".")[0] not in local
    }
    fixed = {k.split("${")[0].rstrip(".") for k in keys}
    return sorted(k for k in fixed if k)


def _present(raw: Any, key: str) -> bool:
    """The dotted key exists in the file (null is a value), as DVC looks it up."""
    node = raw
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def missing_keys(raw: dict[str, Any], keys: list[str]) -> list[str]:
    """The keys absent from `raw`, the most specific only: `curve.fractions` rather than both it
    and `curve` (adding the first adds the second)."""
    missing = [k for k in keys if not _present(raw, k)]
    return [k for k in missing if not any(m.startswith(f"{k}.") for m in missing)]


def _default(key: str) -> str | None:
    """The schema's value for `key`, as one YAML flow item (a section: `{}`, whose keys the
    schema fills); None where the schema has no such key."""
    from eagle3_pipeline.config.params import Params

    node: Any = Params().model_dump(mode="json")
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    if isinstance(node, dict):
        return "{}"
    text = yaml.safe_dump(node, default_flow_style=True).strip()
    return text.removesuffix("...").strip()


def check_params_file(params_path: str | Path, dvc_yaml: str | Path = DVC_YAML) -> list[str]:
    """The keys dvc.yaml reads, all present in the file; one ParamsError naming every missing
    key otherwise. No dvc.yaml (not run from the repository root) or no such file (params made
    in memory): [] (nothing to compare)."""
    dvc_yaml, params_path = Path(dvc_yaml), Path(params_path)
    if not dvc_yaml.is_file() or not params_path.is_file():
        return []
    keys = dvc_params_keys(dvc_yaml.read_text())
    raw = yaml.safe_load(params_path.read_text())
    missing = missing_keys(raw if isinstance(raw, dict) else {}, keys)
    if missing:
        values = ", ".join(f"{k}: {v}" for k in missing if (v := _default(k)) is not None)
        raise ParamsError(
            f"{params_path}: lacks {len(missing)} key(s) that {dvc_yaml}'s stages read, so "
            f"`dvc repro` refuses it: {', '.join(missing)}: add them"
            + (f", e.g. with the schema's defaults: {values}" if values else "")
            + " (every profile in profiles/ has them; params.py documents each)"
        )
    return keys
