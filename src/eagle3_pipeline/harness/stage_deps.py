"""What a DVC stage depends on besides data: the package modules it imports and the files its
params point to.

The code closure keeps each stage's `deps` in dvc.yaml exact (scripts/dvc_deps.py writes them);
rows made by older code are keyed by each stage's ROW_VERSION instead (core/resume.py). Path
params (`verifier.tiny.corpus`, `train.init_from`) name files anywhere, often machine-specific
(`/models/...`), so they never go into dvc.yaml (tracked, the same for every teammate): DVC sees a
path param's value, through the stage's params, and a path under one of the stage's deps. For any
other path the CLI records a fingerprint when the stage runs (git-ignored, in
data/.work/path_params.json), and scripts/dvc_deps.py (`make train`) refuses to start while the
files at an unchanged path differ from what the stage last read, naming the stages to rerun.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from eagle3_pipeline.core import atomic

PKG = Path(__file__).resolve().parents[1]  # src/eagle3_pipeline
GUESTS = PKG / "in_vllm"  # the code vLLM loads by name (in_vllm/entry_points.py)
_DOTTED = re.compile(r"eagle3_pipeline(\.[A-Za-z_]\w*)+")
PARAM_MARK = "# param: "  # marks a path param's dep line, which dvc.yaml never holds
RECORDS = Path("data/.work/path_params.json")  # {stage: {key: {path, fingerprint}}}, git-ignored
# Which stages read a file through which path param.
PATH_PARAMS: dict[str, tuple[str, ...]] = {
    "verifier": ("verifier.tiny.corpus",),
    "train": ("train.init_from",),
    "export": ("train.init_from",),
    "evaluate": ("train.init_from",),
}


def module_file(name: str) -> Path:
    rel = name.removeprefix("eagle3_pipeline").lstrip(".").replace(".", "/")
    path = PKG / f"{rel}.py"
    return path if path.is_file() else PKG / rel / "__init__.py"


def _nodes(path: Path) -> tuple[ast.AST, ...]:
    """Every node of `path`'s syntax tree, parsed once per version of the file (imports and
    named both walk it, for every module of every stage's closure)."""
    stat = path.stat()
    return _parsed(path, stat.st_mtime_ns, stat.st_size)


@functools.cache
def _parsed(path: Path, _mtime_ns: int, _size: int) -> tuple[ast.AST, ...]:
    return tuple(ast.walk(ast.parse(path.read_text())))


def imports(path: Path) -> set[str]:
    """Package modules `path` imports; `from pkg import mod` counts pkg/mod.py as a module."""
    found = set()
    for node in _nodes(path):
        if (
            isinstance(node, ast.ImportFrom)
            and node.module
            and node.module.startswith("eagle3_pipeline")
        ):
            rel = node.module.removeprefix("eagle3_pipeline").lstrip(".").replace(".", "/")
            package = PKG / rel
            if package.is_dir():
                found |= {
                    f"{node.module}.{a.name}"
                    for a in node.names
                    if (package / f"{a.name}.py").is_file()
                }
            else:
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("eagle3_pipeline.")}
    return found


def named(path: Path) -> set[str]:
    """Modules of the wing vLLM loads by name (in_vllm/) that `path` names in a string
    (`package.module` or `package.module.Class`, in_vllm/entry_points.py): vLLM imports them
    in its processes, so a stage that hands vLLM the name depends on the module."""
    found = set()
    for node in _nodes(path):
        if not (isinstance(node, ast.Constant) and isinstance(node.value, str)):
            continue
        if not _DOTTED.fullmatch(node.value):
            continue
        for name in (node.value, node.value.rpartition(".")[0]):
            file = module_file(name)
            if file.is_file() and file.parent == GUESTS and file.name != "__init__.py":
                found.add(name)
                break
    return found


def closure(module: str) -> set[Path]:
    """Every package file `module` imports, or names for vLLM to load, transitively (empty
    __init__ files left out)."""
    seen: set[str] = set()
    todo = [module]
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        todo.extend(imports(module_file(m)) | named(module_file(m)))
    return {module_file(m) for m in seen if module_file(m).name != "__init__.py"}


def path_params(stage: str, values: Mapping[str, Any]) -> dict[str, str]:
    """{param key: path} of the files this stage reads through its params, where set.

    `values`: the validated params as a mapping (`Params.model_dump()`): PATH_PARAMS names its
    keys as dotted strings, and this module reads nothing else of them."""
    found = {}
    for key in PATH_PARAMS.get(stage, ()):
        if key == "verifier.tiny.corpus" and values["verifier"]["source"] != "tiny":
            continue
        value: Any = values
        for part in key.split("."):
            value = value[part]
        if value:
            found[key] = str(value)
    return found


def dep_path(line: str) -> str:
    """The path of one `      - <path>  # comment` line of a deps block."""
    return line.split("- ", 1)[1].split(" #")[0].strip()


def stage_dep_paths(dvc_text: str, stage: str) -> list[str]:
    """The literal (untemplated) paths in a stage's `deps:` block of dvc.yaml's text."""
    block = re.search(rf"\n  {re.escape(stage)}:\n(?:    [^\n]*\n|      [^\n]*\n)*", dvc_text)
    if block is None:
        return []
    deps = re.search(r"    deps:\n((?:      - [^\n]*\n)+)", block.group(0))
    if deps is None:
        return []
    lines = [dep_path(line) for line in deps.group(1).splitlines()]
    return [d for d in lines if "${" not in d]


def covered(path: str, deps: list[str], root: Path) -> bool:
    target = Path(os.path.abspath(root / path))
    for d in deps:
        dep = Path(os.path.abspath(root / d))
        if target == dep or dep in target.parents:
            return True
    return False


def fingerprint(path: Path) -> str:
    """sha256 of every file's name, size and mtime under `path`: cheap on a checkpoint of many
    GB, and changed by any file replaced, edited, added or removed."""
    if not path.exists():
        return "missing"
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    h = hashlib.sha256()
    for f in files:
        st = f.stat()
        name = f.name if f == path else str(f.relative_to(path))
        h.update(f"{name}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def outside_deps(stage: str, values: Mapping[str, Any], root: Path) -> dict[str, str]:
    """The stage's path params that lie under none of its dvc.yaml deps."""
    dvc_yaml = root / "dvc.yaml"
    deps = stage_dep_paths(dvc_yaml.read_text(), stage) if dvc_yaml.is_file() else []
    return {k: p for k, p in path_params(stage, values).items() if not covered(p, deps, root)}


def _records(root: Path) -> dict[str, dict[str, dict[str, str]]]:
    try:
        return json.loads((root / RECORDS).read_text())
    except (OSError, ValueError):
        return {}


def check_path_params(stage: str, values: Mapping[str, Any], root: Path = Path(".")) -> None:
    """Record what the stage reads through path params outside its deps (the CLI calls this as
    the stage starts), for changed_path_params to compare later."""
    found = outside_deps(stage, values, root)
    records = _records(root)
    if not found and stage not in records:
        return
    records[stage] = {
        k: {"path": p, "fingerprint": fingerprint(root / p)} for k, p in found.items()
    }
    (root / RECORDS).parent.mkdir(parents=True, exist_ok=True)
    atomic.write_text(root / RECORDS, json.dumps(records, indent=1, sort_keys=True) + "\n")


def changed_path_params(values: Mapping[str, Any], root: Path = Path(".")) -> list[str]:
    """One line per path param whose files changed, at the same path, since the stages that read
    it last ran: DVC, which sees only the value, would not rerun them."""
    records = _records(root)
    stale: dict[tuple[str, str], list[str]] = {}
    for stage in PATH_PARAMS:
        for key, path in outside_deps(stage, values, root).items():
            was = records.get(stage, {}).get(key)
            if was and was["path"] == path and was["fingerprint"] != fingerprint(root / path):
                stale.setdefault((key, path), []).append(stage)
    return [
        f"{key}: the files at {path} changed since {', '.join(stages)} last ran, and DVC sees "
        f"only the path: run `dvc repro -f -s {' '.join(stages)}`, then `make train`"
        for (key, path), stages in stale.items()
    ]
