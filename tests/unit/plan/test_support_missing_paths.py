"""A path a stage reads that is not here: `eagle3 plan` and the check stage refuse it before the
first stage, in the one line support.missing_paths words, exit 2 (not prepare, generate or train,
hours later); a plan from config files lists it instead."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from builders import LLAMA, REPO, TINY_LLAMA, fake_verifier, params_file, pretrained
from plan_cases import char_tokenizer

from eagle3_pipeline.cli import main
from eagle3_pipeline.config.params import load_params
from eagle3_pipeline.conversations import prompt_files
from eagle3_pipeline.plan import plan, report, support

TEMPLATE = "{%- for m in messages -%}<{{ m.role }}>{{ m.content }}{%- endfor -%}<assistant>"


@pytest.fixture
def workspace(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """dvc.yaml, the committed prompts and tiny-llama as params.yaml, its verifier swapped for
    a complete pretrained folder `v` (config, weights, tokenizer, template)."""
    shutil.copy(REPO / "dvc.yaml", tmp_path / "dvc.yaml")
    shutil.copytree(REPO / "tests/fixtures/prompts", tmp_path / "data/prompts")
    fake_verifier(char_tokenizer(tmp_path / "v", TEMPLATE), LLAMA, **{"model.safetensors": b""})
    params_file(
        tmp_path / "params.yaml",
        TINY_LLAMA,
        verifier=pretrained("v"),
        generate={"reasoning_parser": None},
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(support, "CACHE", tmp_path / "vllm_classes.json")
    return tmp_path


def _set(section: str, **values: object) -> Callable[[Path], None]:
    def edit(ws: Path) -> None:
        raw = yaml.safe_load((ws / "params.yaml").read_text())
        raw[section].update(values)
        (ws / "params.yaml").write_text(yaml.safe_dump(raw))

    return edit


def _rm(*names: str) -> Callable[[Path], None]:
    def edit(ws: Path) -> None:
        for name in names:
            (ws / "v" / name).unlink()

    return edit


def _one_line(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    return err


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (
            _set("prepare", prompts="data/nope"),
            "data/nope: not found (prepare.prompts in params.yaml): set it to a prompt file "
            "(.jsonl, .json, .parquet) or a folder of them",
        ),
        (
            _set("verifier", path="models/absent"),
            "models/absent/config.json: not found (verifier.path in params.yaml): download the "
            "model (config.json, weights, tokenizer files) there, or set verifier.path to the "
            "folder that holds it",
        ),
        (_rm("model.safetensors"), "v/*.safetensors: not found (verifier.path in params.yaml)"),
        (
            _rm("tokenizer_config.json", "tokenizer.json"),
            "v/tokenizer_config.json: not found (verifier.path in params.yaml): generate and "
            "tokenize load the tokenizer and its chat template from it",
        ),
        (_rm("chat_template.jinja"), "v: no chat template"),
        (
            _set("train", init_from="models/no-drafter"),
            "models/no-drafter/config.json: not found (train.init_from in params.yaml): download "
            "the drafter there, or set train.init_from to the folder that holds it (null: from "
            "scratch)",
        ),
    ],
    ids=["prompts", "verifier-config", "weights", "tokenizer", "chat-template", "init-from"],
)
def test_plan_and_check_refuse_in_the_same_line(
    workspace: Path, capsys: pytest.CaptureFixture[str], edit, expected: str
) -> None:
    assert main(["plan", "--params", "params.yaml", "--tokens", "1000"]) == 0  # complete: plans
    capsys.readouterr()
    edit(workspace)
    planned = _one_line(capsys, ["plan", "--params", "params.yaml", "--tokens", "1000"])
    checked = _one_line(capsys, ["check", "--params", "params.yaml"])
    assert expected in planned and planned == checked


def test_registry_model_not_fetched_names_the_fetch_command(workspace: Path) -> None:
    _set("verifier", path="models/verifiers/smollm2-135m-instruct")(workspace)
    (line,) = map(str, support.missing_paths(load_params("params.yaml"), "params.yaml"))
    assert line.endswith(": run `eagle3 fetch-model smollm2-135m-instruct`")


def test_synthesized_prompts_only_need_no_prompt_set(workspace: Path) -> None:
    _set("prepare", prompts="data/nope", synthesized_share=1.0)(workspace)
    _set("prepare", synthesize={"count": 10})(workspace)
    assert support.missing_paths(load_params("params.yaml"), "params.yaml") == []


def test_tiny_verifier_built_later_is_not_refused(workspace: Path) -> None:
    """The tiny profiles build their verifier in a stage: nothing of it is here yet."""
    shutil.copy(REPO / "profiles/tiny-llama.yaml", workspace / "params.yaml")
    p = plan.make_plan(load_params("params.yaml"), "params.yaml", tokens=1000)
    assert p.not_here == [] and p.support is not None and p.support.built_later


def test_a_plan_from_config_files_lists_what_check_refuses(workspace: Path) -> None:
    _set("prepare", prompts="data/nope")(workspace)
    p = plan.make_plan(load_params("params.yaml"), "params.yaml", verifier_config="v", tokens=1)
    assert p.not_here == [str(support.missing_paths(load_params("params.yaml"), "params.yaml")[0])]
    text = report.render(p)
    assert "not here    data/nope: not found (prepare.prompts in params.yaml)" in text


def test_prompt_suffixes_are_prepares() -> None:
    assert support.PROMPT_SUFFIXES == prompt_files.SUFFIXES
