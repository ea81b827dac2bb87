"""Stage `check`: the checks `eagle3 plan` makes, before any work, and an output that names
what was checked: the same bytes after an ordinary params edit, so nothing downstream reruns."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from builders import fake_verifier

from eagle3_pipeline.cli import main
from eagle3_pipeline.config.params import load_params
from eagle3_pipeline.core import paths
from eagle3_pipeline.core.errors import ParamsError, VerifierError
from eagle3_pipeline.plan import params_keys
from eagle3_pipeline.stages import check

REPO = Path(__file__).resolve().parents[3]
OUTPUT = paths.CHECKED / "checked.json"


@pytest.fixture
def workspace(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """dvc.yaml and the default profile as params.yaml, in a fresh folder (its own vLLM
    answer cache under data/.work)."""
    shutil.copy(REPO / "dvc.yaml", tmp_path / "dvc.yaml")
    shutil.copy(REPO / "profiles/tiny-llama.yaml", tmp_path / "params.yaml")
    shutil.copytree(REPO / "tests/fixtures/prompts", tmp_path / "data/prompts")  # prepare.prompts
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _edit(path: Path, section: str, key: str, value: object) -> None:
    raw = yaml.safe_load(path.read_text())
    raw[section][key] = value
    path.write_text(yaml.safe_dump(raw))


def test_tiny_verifier_is_checked_from_params_and_named_not_valued(workspace: Path) -> None:
    check.run(load_params("params.yaml"), "params.yaml")
    record = json.loads(OUTPUT.read_text())
    dvc_text = (workspace / "dvc.yaml").read_text()
    assert record["params_keys"] == params_keys.dvc_params_keys(dvc_text)
    assert record["verifier"] == {
        "source": "tiny",
        "architectures": ["LlamaForCausalLM"],
        "text_architectures": [],
        "built_later": True,
    }
    assert record["vllm"]["model_class"] == "LlamaForCausalLM"
    assert record["vllm"]["supports_eagle3"] is True
    assert record["chat_template"] == {
        "source": "the project's own (verifier/tiny.py)",
        "rendered": False,
    }
    assert "0.003" not in OUTPUT.read_text()  # no params value (train.lr) is recorded
    first = OUTPUT.read_bytes()

    _edit(workspace / "params.yaml", "train", "lr", 0.001)  # an ordinary edit
    _edit(workspace / "params.yaml", "extract", "backend", "hf")  # needs: not recorded either
    # An earlier build of another verifier in data/verifier does not count: tiny is rebuilt.
    fake_verifier(workspace / "data/verifier", {"architectures": ["OPTForCausalLM"]})
    check.run(load_params("params.yaml"), "params.yaml")
    assert OUTPUT.read_bytes() == first


def test_last_months_params_are_refused_before_anything_is_written(workspace: Path) -> None:
    raw = yaml.safe_load((workspace / "params.yaml").read_text())
    del raw["families"], raw["curve"], raw["train"]["hidden_states"]
    (workspace / "params.yaml").write_text(yaml.safe_dump(raw))
    with pytest.raises(ParamsError, match="curve.fractions, families, train.hidden_states"):
        check.run(load_params("params.yaml"), "params.yaml")
    assert not OUTPUT.exists()


def test_a_learning_curve_without_a_store_is_refused_at_load(workspace: Path) -> None:
    """Online training writes no store for curve_train to read: told at check, before work."""
    _edit(workspace / "params.yaml", "train", "hidden_states", "online")
    _edit(workspace / "params.yaml", "curve", "fractions", [0.5])
    with pytest.raises(ParamsError, match="params.yaml: curve.fractions trains on the hidden"):
        load_params("params.yaml")
    _edit(workspace / "params.yaml", "curve", "fractions", [])
    assert load_params("params.yaml").train.hidden_states == "online"


def test_pretrained_verifier_vllm_cannot_capture_is_refused(workspace: Path) -> None:
    config = {
        "architectures": ["Gemma2ForCausalLM"],
        "model_type": "gemma2",
        "num_hidden_layers": 2,
        "hidden_size": 64,
        "vocab_size": 512,
    }
    # weights present: vLLM's class is what fails
    folder = fake_verifier(
        workspace / "models/gemma2", config, tokenizer_config={}, **{"model.safetensors": b""}
    )
    _edit(workspace / "params.yaml", "verifier", "source", "pretrained")
    _edit(workspace / "params.yaml", "verifier", "path", str(folder))
    with pytest.raises(VerifierError, match="Gemma2ForCausalLM does not implement SupportsEagle3"):
        check.run(load_params("params.yaml"), "params.yaml")
    assert not OUTPUT.exists()


def test_cli_runs_the_stage(workspace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "--params", "params.yaml"]) == 0
    out = capsys.readouterr().out
    assert "[check] vLLM " in out and "LlamaForCausalLM (model registry) implements" in out
    assert OUTPUT.is_file()


def test_a_hand_run_on_another_params_file_leaves_the_committed_record(
    workspace: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """metrics/provenance/check.json is DVC's run of params.yaml: `eagle3 check --params
    other.yaml` (a profile's pre-flight) must not rewrite it; params.yaml still does."""
    record = workspace / paths.PROVENANCE / "check.json"
    record.parent.mkdir(parents=True)
    record.write_text('{"committed": true}\n')
    shutil.copy(workspace / "params.yaml", workspace / "other.yaml")
    assert main(["check", "--params", "other.yaml"]) == 0
    assert record.read_text() == '{"committed": true}\n'
    assert f"[check] other.yaml is not params.yaml: {paths.PROVENANCE}/check.json left" in (
        capsys.readouterr().out
    )
    assert main(["check", "--params", "./params.yaml"]) == 0
    assert json.loads(record.read_text())["stage"] == "check"
