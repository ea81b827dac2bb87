"""What a DVC stage depends on besides data: the package modules it imports and the files its
params point to.

The code closure keeps each stage's `deps` in dvc.yaml exact (scripts/dvc_deps.py writes them) and
fingerprints resumable scratch work, so rows made by older code never survive a code fix. Path
params (`verifier.tiny.corpus`, `train.init_from`) name files anywhere: each must lie under one of
its stage's deps, or DVC would not rerun the stage when that file changes; scripts/dvc_deps.py
adds such a path as a dep line marked `# param: <key>`, and the CLI refuses a stage whose params
point outside its deps.
"""

from __future__ import annotations

import ast
import hashlib
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

from eagle3_pipeline.core.errors import ParamsError

if TYPE_CHECKING:
    from eagle3_pipeline.config.params import Params

PKG = Path(__file__).resolve().parents[1]  # src/eagle3_pipeline
PARAM_MARK = "# param: "
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


def imports(path: Path) -> set[str]:
    """Package modules `path` imports; `from pkg import mod` counts pkg/mod.py as a module."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
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


def closure(module: str) -> set[Path]:
    """Every package file `module` imports, transitively (empty __init__ files left out)."""
    seen: set[str] = set()
    todo = [module]
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        todo.extend(imports(module_file(m)))
    return {module_file(m) for m in seen if module_file(m).name != "__init__.py"}


def code_sha256(stage: str) -> str:
    """One hash over the source of every module the stage imports."""
    h = hashlib.sha256()
    for f in sorted(closure(f"eagle3_pipeline.stages.{stage}")):
        h.update(str(f.relative_to(PKG)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def path_params(stage: str, params: Params) -> dict[str, str]:
    """{param key: path} of the files this stage reads through its params, where set."""
    found = {}
    for key in PATH_PARAMS.get(stage, ()):
        if key == "verifier.tiny.corpus" and params.verifier.source != "tiny":
            continue
        section, *rest = key.split(".")
        value = getattr(params, section)
        for attr in rest:
            value = getattr(value, attr)
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


def check_path_params(stage: str, params: Params, root: Path = Path(".")) -> None:
    """Refuse a stage whose params point at a file dvc.yaml does not list as its dependency."""
    dvc_yaml = root / "dvc.yaml"
    if not dvc_yaml.is_file():
        return
    deps = stage_dep_paths(dvc_yaml.read_text(), stage)
    for key, path in path_params(stage, params).items():
        if not covered(path, deps, root):
            raise ParamsError(
                f"dvc.yaml: stage {stage} does not list {key} ({path}) as a dependency, so DVC "
                "would not rerun it when that file changes: run `python scripts/dvc_deps.py` "
                "(`make train` does)"
            )
