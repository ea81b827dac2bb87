"""Each DVC stage's code deps = the package modules it imports, transitively; rewrite dvc.yaml.

`python scripts/dvc_deps.py` rewrites the `${pkg}/...` lines of every stage in dvc.yaml from the
import closure of `eagle3_pipeline.stages.<stage>` (other deps, data and params, stay as they
are); `--check` only reports. tests/unit/test_dvc_yaml.py runs the same closure.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
PKG = REPO / "src/eagle3_pipeline"


def module_file(name: str) -> Path:
    rel = name.removeprefix("eagle3_pipeline").lstrip(".").replace(".", "/")
    path = PKG / f"{rel}.py"
    return path if path.is_file() else PKG / rel / "__init__.py"


def imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.ImportFrom)
            and node.module
            and node.module.startswith("eagle3_pipeline")
        ):
            # `from pkg import mod` imports pkg/mod.py when mod is a module, not a name
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
    seen: set[str] = set()
    todo = [module]
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        todo.extend(imports(module_file(m)))
    return {module_file(m) for m in seen if module_file(m).name != "__init__.py"}


def stage_deps(stage: str) -> list[str]:
    """The stage's own module first, then package modules by folder, then top-level ones."""
    rels = sorted(str(p.relative_to(PKG)) for p in closure(f"eagle3_pipeline.stages.{stage}"))
    own = f"stages/{stage}.py"
    rels.remove(own)
    return [own] + [r for r in rels if "/" in r] + [r for r in rels if "/" not in r]


def rewrite(text: str, stages: list[str]) -> str:
    for stage in stages:
        m = re.search(rf"(\n  {stage}:\n    cmd: [^\n]*\n    deps:\n)((?:      - [^\n]*\n)+)", text)
        if m is None:
            raise SystemExit(f"dvc.yaml: stage {stage}: expected `cmd:` then `deps:` lines")
        others = [line for line in m.group(2).splitlines(True) if "${pkg}" not in line]
        code = "".join(f"      - ${{pkg}}/{r}\n" for r in stage_deps(stage))
        text = text.replace(m.group(0), m.group(1) + code + "".join(others))
    return text


def main(argv: list[str]) -> int:
    dvc_yaml = REPO / "dvc.yaml"
    text = dvc_yaml.read_text()
    new = rewrite(text, list(yaml.safe_load(text)["stages"]))
    if "--check" in argv:
        print("dvc.yaml deps match the imports" if new == text else "dvc.yaml deps are stale")
        return int(new != text)
    dvc_yaml.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
