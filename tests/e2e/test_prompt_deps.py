"""A prompt set anywhere params point (outside data/prompts, outside the repo) is a DVC
dependency of prepare: editing it reruns prepare, as dvc.yaml templates `${prepare.prompts}`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pipeline_repo import make_repo, run_in


def _rows(start: int, n: int) -> str:
    return "".join(
        json.dumps({"id": f"x{i:04d}", "messages": [{"role": "user", "content": f"q {i}"}]}) + "\n"
        for i in range(start, start + n)
    )


@pytest.mark.slow
def test_appending_to_a_prompt_file_outside_the_repo_reruns_prepare(tmp_path: Path) -> None:
    prompts = tmp_path / "elsewhere" / "mine.jsonl"
    prompts.parent.mkdir()
    prompts.write_text(_rows(0, 20))
    repo = tmp_path / "repo"
    repo.mkdir()
    # prepare reads the check and synthesize stages' outputs, and synthesize the verifier's:
    # built untrained here (prepare never runs it), in seconds
    make_repo(
        repo,
        {
            "prepare": {"prompts": str(prompts), "val_ratio": 0.1},
            "verifier": {"tiny": {"train_steps": 0}},
        },
    )
    run_in(repo, "dvc", "repro", "prepare")
    assert "up to date" in run_in(repo, "dvc", "status", "prepare")

    with prompts.open("a") as fh:
        fh.write(_rows(20, 10))
    status = run_in(repo, "dvc", "status", "prepare")
    assert "changed deps" in status and str(prompts) in status
    run_in(repo, "dvc", "repro", "--single-item", "prepare")
    n = sum(
        len((repo / "data/prepared" / f"{s}.jsonl").read_text().splitlines())
        for s in ("train", "val")
    )
    assert n == 30
