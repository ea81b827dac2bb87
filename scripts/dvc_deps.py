"""Each DVC stage's deps = the package modules it imports, transitively; and the files its path
params point to (`verifier.tiny.corpus`, `train.init_from`) are what the stage last read.

`python scripts/dvc_deps.py` rewrites the `${pkg}/...` lines of every stage in dvc.yaml from the
import closure of `eagle3_pipeline.stages.<stage>` (other deps, data and params, stay as they are),
so dvc.yaml changes only with the code, never with params.yaml or the machine: a path param names
a machine's files (`/models/...`) and stays out of it. Instead, where such a path lies under none
of its stage's deps, this refuses (exit 2, one line per path) while the files there differ from
those the stage last read (harness/stage_deps.py records them). `--check` only reports. `make
train` runs it before `dvc repro`; tests/unit/test_dvc_yaml.py runs the same closure.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from eagle3_pipeline.config.params import load_params  # noqa: E402
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


def rewrite(text: str, stages: list[str]) -> str:
    """The code lines of each stage's deps from its imports; a `# param:` line (a path param's
    files, machine-specific) is dropped."""
    for name in stages:
        m, indent = _block(text, name)
        # The modules are the command's (`eagle3 train --family ...` runs stages/train.py).
        commands = list(dict.fromkeys(re.findall(r"eagle3 (\w+)", m.group(1))))
        others = [
            line
            for line in m.group(2).splitlines(True)
            if "${pkg}" not in line and stage_deps.PARAM_MARK not in line
        ]
        code = "".join(f"{indent}- ${{pkg}}/{r}\n" for r in stage_deps_lines(*commands))
        text = text.replace(m.group(0), m.group(1) + code + "".join(others))
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


def main(argv: list[str], root: Path = REPO) -> int:
    dvc_yaml = root / "dvc.yaml"
    text = dvc_yaml.read_text()
    new = check_params(rewrite(text, list(yaml.safe_load(text)["stages"])))
    if "--check" in argv:
        print("dvc.yaml deps match the imports" if new == text else "dvc.yaml deps are stale")
        return int(new != text)
    if new != text:
        dvc_yaml.write_text(new)
        print("dvc.yaml: stage deps rewritten from the imports")
    params_file = root / "params.yaml"
    if params_file.is_file():
        changed = stage_deps.changed_path_params(load_params(params_file).model_dump(), root)
        for line in changed:
            print(f"error: {line}", file=sys.stderr)
        if changed:
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
