"""A stage's outputs as a teammate's checkout holds them after `dvc pull`: in the DVC cache and
named by dvc.lock, while `dvc repro` has deleted them from the workspace and the scratch folder
(data/.work/) was never there."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import yaml


def commit(root: Path, stage: str, outs: list[str], cache_type: str | None = None) -> None:
    """Make `root` a DVC project (no git) whose stage `stage` has `outs`, and commit what the
    workspace holds there to its cache and dvc.lock (as a finished `dvc repro` leaves them)."""
    from dvc.logger import set_loggers_level
    from dvc.repo import Repo

    # DVC's log handlers hold the stdout of the test that first imported dvc (capsys's, closed
    # since): its INFO lines ("Initialized DVC repository") would fail to print.
    with set_loggers_level(logging.WARNING):
        if not (root / ".dvc").is_dir():
            Repo.init(str(root), no_scm=True).close()
            if cache_type:
                with open(root / ".dvc/config", "a") as fh:
                    fh.write(f"[cache]\n    type = {cache_type}\n")
        dvc_yaml = root / "dvc.yaml"
        spec = yaml.safe_load(dvc_yaml.read_text()) if dvc_yaml.is_file() else {"stages": {}}
        spec["stages"][stage] = {"cmd": "true", "outs": outs}
        dvc_yaml.write_text(yaml.safe_dump(spec))
        repo = Repo(str(root))
        try:
            repo.commit(stage, force=True)
        finally:
            repo.close()


def pulled_only(root: Path, outs: list[str]) -> None:
    """Delete the outputs from the workspace (DVC does before it runs their stage) and the
    scratch folder: only the cache and dvc.lock remain."""
    for out in outs:
        shutil.rmtree(root / out)
    shutil.rmtree(root / "data/.work", ignore_errors=True)
