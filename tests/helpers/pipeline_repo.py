"""Pipeline runs for end-to-end tests: a fresh git copy of the repo, shrunk params, `dvc repro`."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]

SMALL = {
    "verifier": {
        "tiny": {
            "train_steps": 150,  # a verifier whose answers carry a learnable signal
            "vocab_size": 1024,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
        }  # head_dim 32 for vLLM CPU
    },
    "prepare": {"max_prompts": 60, "val_ratio": 0.2},
    "generate": {"max_new_tokens": 32},
    "evaluate": {"max_eval_prompts": 6, "max_new_tokens": 24},
    "tokenize": {"max_seq_len": 128},
    "vocab": {"draft_vocab_size": 256},
    "train": {"epochs": 8, "max_tokens_per_batch": 512},
}


def merge(base: dict, over: dict) -> dict:
    for k, v in over.items():
        base[k] = merge(base.get(k, {}), v) if isinstance(v, dict) else v
    return base


def repo_env(repo: Path | None = None, site: Path | None = None) -> dict[str, str]:
    """The venv's tools; stages import the code of the repo they run in, not the editable install
    (its files may change while a run takes minutes, and dvc.lock hashes the repo's own copy).
    `site`: a folder put first on PYTHONPATH (a sitecustomize.py that every process runs)."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
    env.update(DVC_NO_ANALYTICS="1", HF_HUB_OFFLINE="1")
    if repo is not None and (repo / "src/eagle3_pipeline").is_dir():
        env["PYTHONPATH"] = str(repo / "src")
    if site is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))
    return env


def run_in(repo: Path, *cmd: str, site: Path | None = None) -> str:
    env = repo_env(repo, site)
    proc = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, f"{cmd} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout + proc.stderr


def make_repo(repo: Path, overrides: dict) -> Path:
    """A fresh git repo holding the project's tracked files, params shrunk by `overrides`."""
    files = subprocess.run(  # tracked and new (not ignored) files: the working tree's code
        ["git", "ls-files", "-co", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    for f in files:
        if not (REPO / f).is_file():
            continue  # deleted in the working tree, not yet committed
        (repo / f).parent.mkdir(parents=True, exist_ok=True)
        (repo / f).write_bytes((REPO / f).read_bytes())
    params = merge(yaml.safe_load((repo / "params.yaml").read_text()), overrides)
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    run_in(repo, "git", "init", "-q")
    commit(repo, "init")
    return repo


def commit(repo: Path, message: str) -> str:
    run_in(repo, "git", "add", "-A")
    who = ("-c", "user.name=t", "-c", "user.email=t@t")
    run_in(repo, "git", *who, "commit", "-qm", message, "--allow-empty")
    return run_in(repo, "git", "rev-parse", "HEAD").strip()


def session_run(
    tmp_path_factory: pytest.TempPathFactory, name: str, overrides: dict, site: Path | None = None
) -> Path:
    """The pipeline run once per test session, shared by every module that asks for `name`.

    Module fixtures of different files are separate objects; the session's base temp folder and
    a marker written after a successful `dvc repro` make them share one run.
    """
    repo = tmp_path_factory.getbasetemp() / name / "repo"
    done = repo.parent / "repro-done"
    if done.is_file():
        return repo
    if repo.parent.exists():
        shutil.rmtree(repo.parent)
    # For iterating on the slow tests: EAGLE3_E2E_REUSE=<dir> copies a finished <dir>/<name>/
    # (a previous session's basetemp) instead of running the DAG again; the copy keeps its links.
    reuse = Path(os.environ.get("EAGLE3_E2E_REUSE", "/nonexistent")) / name
    if (reuse / "repro-done").is_file():
        subprocess.run(["cp", "-a", str(reuse), str(repo.parent)], check=True)
        return repo
    repo.mkdir(parents=True)
    make_repo(repo, overrides)
    run_in(repo, "dvc", "repro", site=site)
    done.write_text("ok\n")
    return repo


def tiny_pipeline(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shrunken default pipeline (vLLM backends, online evaluation) run by `dvc repro`."""
    return session_run(tmp_path_factory, "e2e", SMALL)
