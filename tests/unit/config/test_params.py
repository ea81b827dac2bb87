"""params.yaml validation: every user mistake is one clear line and a non-zero exit."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from eagle3_pipeline.cli import main
from eagle3_pipeline.config.params import load_params
from eagle3_pipeline.core.errors import ParamsError

REPO = Path(__file__).resolve().parents[3]


def _write(tmp_path: Path, mutate) -> Path:
    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    mutate(raw)
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_committed_params_and_profiles_are_valid() -> None:
    load_params(REPO / "params.yaml")
    for profile in (REPO / "profiles").glob("*.yaml"):
        load_params(profile)


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [
        (lambda p: p["train"].update(epochz=3), "unknown key 'train.epochz'"),
        (lambda p: p.update(tarin={"epochs": 1}), "unknown key 'tarin'"),
        (lambda p: p["train"].update(epochs="three"), "field 'train.epochs'"),
        (lambda p: p["train"].update(lr=-1), "field 'train.lr'"),
        (lambda p: p["layers"].update(aux_layer_ids=[2, 4, 9]), "out of range"),
        (lambda p: p["layers"].update(aux_layer_ids=[2, 4, 4]), "has duplicates"),
        (lambda p: p["layers"].update(final_layer_id=7), "final id must equal num_hidden_layers"),
        (lambda p: p["vocab"].update(draft_vocab_size=10**6), "larger than the verifier vocab"),
        (lambda p: p["prepare"].update(val_ratio=1.5), "field 'prepare.val_ratio'"),
        (
            lambda p: p["train"].update(hidden_states="online", num_workers=2),
            "loader workers would not send the key",
        ),
    ],
)
def test_bad_params_one_line(tmp_path: Path, mutate, expected: str, capsys) -> None:
    path = _write(tmp_path, mutate)
    with pytest.raises(ParamsError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        load_params(path)
    rc = main(["prepare", "--params", str(path)])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.count("\n") == 1 and "Traceback" not in err
    assert str(path) in err and expected in err


def test_online_loader_workers_are_fine_against_a_server_the_user_names(tmp_path: Path) -> None:
    """Only the server train starts holds a key for certain; a named one may not want one."""

    def online(p: dict) -> None:
        p["train"].update(hidden_states="online", num_workers=2)
        p["train"].setdefault("online", {})["endpoint"] = "http://gpu-node:8000/v1"

    assert load_params(_write(tmp_path, online)).train.num_workers == 2


def test_missing_and_malformed_files(tmp_path: Path, capsys) -> None:
    assert main(["prepare", "--params", str(tmp_path / "nope.yaml")]) == 2
    assert "file not found" in capsys.readouterr().err
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [1, 2\n")
    assert main(["prepare", "--params", str(bad)]) == 2
    assert "not valid YAML" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", "file is empty"),
        ("# only a comment\n\n", "file is empty"),
        ("- verifier\n- train\n", "top level is a list, not a mapping"),
        ("tiny-llama\n", "top level is a str, not a mapping"),
        (b"train:\n  lr: \xff\xfe\n", "not valid YAML"),
    ],
)
def test_empty_or_non_mapping_params_refused(
    tmp_path: Path, text: str | bytes, expected: str, capsys
) -> None:
    path = tmp_path / "params.yaml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    assert main(["prepare", "--params", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(path) in err and expected in err


def test_default_aux_ids_need_seven_layers(tmp_path: Path) -> None:
    def mutate(p):
        p["layers"] = {"aux_layer_ids": None, "final_layer_id": None}
        p["verifier"]["tiny"]["num_hidden_layers"] = 6

    with pytest.raises(ParamsError, match="at least 7"):
        load_params(_write(tmp_path, mutate))
