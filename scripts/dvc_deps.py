"""Each DVC stage's deps = the package modules it imports, transitively, plus the files its path
params point to (`verifier.tiny.corpus`, `train.init_from`) where no other dep holds them.

`python scripts/dvc_deps.py` rewrites the `${pkg}/...` lines of every stage in dvc.yaml from the
import closure of `eagle3_pipeline.stages.<stage>` and the `# param:` lines from params.yaml
(other deps, data and params, stay as they are); `--check` only reports. `make train` runs it
before `dvc repro`; tests/unit/test_dvc_yaml.py runs the same closure.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from eagle3_pipeline.config.params import Params, load_params  # noqa: E402
from eagle3_pipeline.harness import stage_deps  # noqa: E402

PKG = stage_deps.PKG
closure = stage_deps.closure
imports = stage_deps.imports


def stage_deps_lines(*stages: str) -> list[str]:
    """The stages' own modules first (a command `eagle3 a ... && eagle3 b ...` runs both), then
    package modules by folder, then top-level ones."""
    rels = sorted(
        {str(p.relative_to(PKG)) for s in stages for p in closure(f"eagle3_pipeline.stages.{s}")}
    )
    own = [f"stages/{s}.py" for s in stages]
    rels = [r for r in rels if r not in own]
    return own + [r for r in rels if "/" in r] + [r for r in rels if "/" not in r]


def _block(text: str, stage: str) -> tuple[re.Match[str], str]:
    """The stage's `cmd:` + `deps:` lines and the indent of its deps (a `foreach` stage's are
    under `do:`, two spaces deeper)."""
    plain = rf"(\n  {stage}:\n    cmd: [^\n]*\n    deps:\n)((?:      - [^\n]*\n)+)"
    foreach = rf"(\n  {stage}:\n    foreach: [^\n]*\n    do:\n      cmd: [^\n]*\n      deps:\n)"
    for pattern, indent in ((plain, "      "), (foreach + r"((?:        - [^\n]*\n)+)", "  " * 4)):
        m = re.search(pattern, text)
        if m is not None:
            return m, indent
    raise SystemExit(f"dvc.yaml: stage {stage}: expected `cmd:` then `deps:` lines")


def rewrite(text: str, stages: list[str], params: Params | None = None) -> str:
    for name in stages:
        m, indent = _block(text, name)
        # The modules are the command's (`eagle3 train --family ...` runs stages/train.py).
        commands = list(dict.fromkeys(re.findall(r"eagle3 (\w+)", m.group(1))))
        stage = commands[0]
        others = [
            line
            for line in m.group(2).splitlines(True)
            if "${pkg}" not in line and stage_deps.PARAM_MARK not in line
        ]
        code = "".join(f"{indent}- ${{pkg}}/{r}\n" for r in stage_deps_lines(*commands))
        wanted = stage_deps.path_params(stage, params) if params is not None else {}
        literal = [d for d in map(stage_deps.dep_path, others) if "${" not in d]
        extra = "".join(
            f"{indent}- {path}  {stage_deps.PARAM_MARK}{key}\n"
            for key, path in wanted.items()
            if not stage_deps.covered(path, literal, REPO)
        )
        text = text.replace(m.group(0), m.group(1) + code + "".join(others) + extra)
    return text


def check_params(text: str) -> str:
    """The `check` stage's params = every key another stage lists (but per-branch ones, whose
    section `families` or `curve` DVC itself needs to parse dvc.yaml at all)."""
    stages = yaml.safe_load(text)["stages"]
    keys = sorted(
        {
            key
            for name, stage in stages.items()
            if name != "check"
            for key in stage.get("do", stage).get("params", [])
            if isinstance(key, str) and "${" not in key
        }
    )
    # A key under a listed section is in it already.
    keys = [k for k in keys if not any(k.startswith(f"{other}.") for other in keys)]
    m = re.search(r"(\n  check:\n(?:    [^\n]*\n)*?    params:\n)((?:      - [^\n]*\n)+)", text)
    if m is None:
        raise SystemExit("dvc.yaml: stage check: expected a `params:` list")
    return text.replace(m.group(0), m.group(1) + "".join(f"      - {k}\n" for k in keys))


def main(argv: list[str]) -> int:
    dvc_yaml = REPO / "dvc.yaml"
    text = dvc_yaml.read_text()
    params_file = REPO / "params.yaml"
    params = load_params(params_file) if params_file.is_file() else None
    new = check_params(rewrite(text, list(yaml.safe_load(text)["stages"]), params))
    if "--check" in argv:
        print("dvc.yaml deps match the imports" if new == text else "dvc.yaml deps are stale")
        return int(new != text)
    if new != text:
        dvc_yaml.write_text(new)
        print("dvc.yaml: stage deps rewritten (imports and path params)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
