"""paths.py and dvc.yaml name the same DVC paths: a path moved in one is moved in the other."""

from __future__ import annotations

from pathlib import Path

import yaml

from eagle3_pipeline.core import paths

REPO = Path(__file__).resolve().parents[3]
# Paths the pipeline uses that are not DVC outputs or deps, and why.
NOT_IN_DVC_YAML = {
    "METRICS": "the folder of every metrics file; dvc.yaml names the files",
    "PROVENANCE": "written by the CLI after each stage, committed with dvc.lock, not an output",
    "SCRATCH": "resume state of long stages: never a DVC output (persist would copy it)",
    "VLLM_CACHE": "vLLM's compile cache, under SCRATCH",
    "PROMPTS": "the default of prepare.prompts, a templated dep (${prepare.prompts})",
    "REAL_MODELS": "real verifiers `eagle3 fetch-model` writes; verifier.path points at one",
    "CURVE_PLOTS": "the folder of the curve's plot series; dvc.yaml names the files",
}


def _constants() -> dict[str, Path]:
    return {k: v for k, v in vars(paths).items() if k.isupper() and isinstance(v, Path)}


def _dvc_paths() -> set[str]:
    stages = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    found: set[str] = set()
    for stage in stages.values():
        body = stage.get("do", stage)  # a `foreach` stage's entries are under `do`
        for key in ("deps", "outs", "metrics", "plots"):
            for entry in body.get(key, []):
                found.add(next(iter(entry)) if isinstance(entry, dict) else entry)
    # A branch's folder (models/families/${key}, models/curve/${item}) is the folder of its
    # family or fraction under the constant.
    for var in ("/${key}", "/${item}"):
        found = {p.split(var)[0] if var in p else p for p in found}
    return {p for p in found if "${" not in p}


def test_every_path_constant_is_in_dvc_yaml_or_says_why_not() -> None:
    dvc = {Path(p) for p in _dvc_paths()}
    for name, path in _constants().items():
        if name in NOT_IN_DVC_YAML:
            assert path not in dvc, f"paths.{name} is in dvc.yaml: drop it from NOT_IN_DVC_YAML"
            continue
        inside = path in dvc or any(d in path.parents for d in dvc)
        assert inside, f"paths.{name} = {path} is not a path dvc.yaml names (nor under one)"


def test_every_data_path_of_dvc_yaml_is_a_path_constant() -> None:
    known = {str(p) for p in _constants().values()}
    for p in _dvc_paths():
        if p.startswith("src/"):
            continue  # code deps: scripts/dvc_deps.py keeps them exact
        assert p in known, f"dvc.yaml names {p}: define it once in paths.py"


def test_scratch_is_git_ignored_and_outside_every_output() -> None:
    ignored = (REPO / ".gitignore").read_text().split()
    assert any(line.strip("/") in {"data/.work", ".work"} for line in ignored), ignored
    for p in _dvc_paths():
        assert paths.SCRATCH not in Path(p).parents and Path(p) != paths.SCRATCH
