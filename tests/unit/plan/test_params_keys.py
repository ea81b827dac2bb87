"""A params file written before keys were added: plan and the check stage name every key
dvc.yaml reads that it lacks, in one line, where DVC would name one at a time."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from plan_cases import REPO

from eagle3_pipeline.cli import main
from eagle3_pipeline.config.params import load_params
from eagle3_pipeline.core.errors import ParamsError
from eagle3_pipeline.plan import params_keys, plan

DVC_YAML = REPO / "dvc.yaml"
# What last month's template lacked: the keys added since (the schema defaults each).
LAST_MONTH_MISSING = [
    "cluster.nodes",
    "cluster.train_nodes",
    "curve.fractions",
    "families",
    "prepare.synthesize",
    "train.hidden_states",
]


def _last_months_template(tmp_path: Path) -> Path:
    """profiles/tiny-llama.yaml as it was written a month ago: no families, no
    train.hidden_states, no cluster, no curve, no prepare.synthesize."""
    raw = yaml.safe_load((REPO / "profiles/tiny-llama.yaml").read_text())
    for section in ("families", "cluster", "curve"):
        del raw[section]
    del raw["train"]["hidden_states"]
    del raw["prepare"]["synthesize"]
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_keys_come_from_stage_params_and_interpolations() -> None:
    text = """
vars:
  - pkg: src/eagle3_pipeline
stages:
  a:
    cmd: run ${pkg} ${item}
    deps:
      - ${prepare.prompts}   # interpolated from params.yaml: DVC needs it to parse
    params:
      - train
      - generate.chat_template_kwargs
      - other.yaml:
          - x
      - params.yaml:
          - seed
  family:
    foreach: ${families}
    do:
      cmd: run ${key}
      params:
        - families.${key}
        - vocab
  curve_train:
    foreach: ${curve.fractions}
    do:
      cmd: run ${item}
"""
    assert params_keys.dvc_params_keys(text) == [
        "curve.fractions",
        "families",
        "generate.chat_template_kwargs",
        "prepare.prompts",
        "seed",
        "train",
        "vocab",
    ]


def test_most_specific_missing_key_is_named_once() -> None:
    keys = ["curve", "curve.fractions", "train", "train.hidden_states", "seed"]
    raw = {"train": {"lr": 0.1}, "seed": None}  # null is a value: present
    assert params_keys.missing_keys(raw, keys) == ["curve.fractions", "train.hidden_states"]


def test_every_profile_holds_every_key_dvc_yaml_reads() -> None:
    for profile in sorted((REPO / "profiles").glob("*.yaml")):
        assert params_keys.check_params_file(profile, DVC_YAML), profile


def test_last_months_template_is_refused_naming_every_missing_key(tmp_path: Path) -> None:
    path = _last_months_template(tmp_path)
    load_params(path)  # the schema defaults every key it lacks: only DVC would refuse it
    with pytest.raises(ParamsError) as err:
        params_keys.check_params_file(path, DVC_YAML)
    line = str(err.value)
    assert "\n" not in line
    named = line.split("`dvc repro` refuses it: ")[1].split(": add them")[0]
    assert named.split(", ") == LAST_MONTH_MISSING
    # The fix gives what the schema would have used, one YAML item each.
    for default in (
        "cluster.nodes: 1",
        "cluster.train_nodes: null",
        "curve.fractions: []",
        "families: {}",
        "prepare.synthesize: {}",
        "train.hidden_states: store",
    ):
        assert default in line


def test_plan_refuses_it_first_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _last_months_template(tmp_path)
    monkeypatch.chdir(REPO)  # where `make train` runs plan: dvc.yaml beside params.yaml
    with pytest.raises(ParamsError, match="train.hidden_states"):
        plan.make_plan(load_params(path), path, tokens=1)
    assert main(["plan", "--params", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert all(key in err for key in LAST_MONTH_MISSING)


def test_no_dvc_yaml_or_no_file_compares_nothing(tmp_path: Path) -> None:
    path = _last_months_template(tmp_path)
    assert params_keys.check_params_file(path, tmp_path / "dvc.yaml") == []
    assert params_keys.check_params_file(tmp_path / "in-memory", DVC_YAML) == []
