"""The pipeline runs of tests/e2e/test_own_verifier.py: a verifier the user brings (its own
folder, a hub id as its name, a foreign template), every hub download patched to raise.

Defined here, not in the test module, so that the session can start them in the background
before that module's turn (tests/conftest.py, pipeline_repo.Lane).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
from offline_hub import UNREACHABLE_HUB_ID, sitecustomize_dir
from pipeline_repo import SMALL, Run
from templates import CHATML_DEFAULT_SYSTEM, KIMI_MODEL_OPENS_THINK
from verifiers import build_pretrained_like, retemplated

HELPERS = Path(__file__).resolve().parent
TINY = SMALL["verifier"]["tiny"]


def hubless_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The session's sitecustomize folder that makes every hub download raise."""
    return sitecustomize_dir(tmp_path_factory.getbasetemp() / "hubless")


def downloads(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The user's models (built by the runs' setup): ChatML with a default system prompt, and
    Kimi's template with a generation prompt that leaves `<think>` to the model."""
    root = tmp_path_factory.getbasetemp() / "downloads" / "models"
    return {"chatml": root / "tiny-chatml", "thinker": root / "tiny-thinker"}


def build_downloads(root: Path) -> None:
    """One trained tiny model (seconds) under both templates, once per session."""
    if (root / "built").is_file():
        return
    shutil.rmtree(root, ignore_errors=True)
    chatml = build_pretrained_like(root / "tiny-chatml", CHATML_DEFAULT_SYSTEM, **TINY)
    retemplated(chatml, root / "tiny-thinker", KIMI_MODEL_OPENS_THINK)
    (root / "built").write_text("ok\n")


def _run(
    tmp_path_factory: pytest.TempPathFactory,
    name: str,
    model: str,
    targets: tuple[str, ...] = (),
    **generate: object,
) -> Run:
    verifier = downloads(tmp_path_factory)[model]
    build = "import sys; from pathlib import Path; sys.path.insert(0, sys.argv[1]); "
    build += "from own_verifier_runs import build_downloads; build_downloads(Path(sys.argv[2]))"
    overrides = SMALL | {
        "verifier": {"source": "pretrained", "path": str(verifier), "name": UNREACHABLE_HUB_ID},
        "generate": SMALL["generate"] | generate,
        # Served on the val prompts alone: the public sets go through the same template code,
        # served in the main run (tests/e2e/test_pipeline_e2e.py).
        "evaluate": SMALL["evaluate"] | {"public_sets": []},
    }
    return Run(
        name,
        overrides,
        targets=targets,
        site=hubless_site(tmp_path_factory),
        setup=(sys.executable, "-c", build, str(HELPERS), str(verifier.parent)),
    )


def own_run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """The whole DAG, online evaluation included, on the ChatML model (no reasoning parser)."""
    return _run(tmp_path_factory, "own-verifier", "chatml", reasoning_parser=None)


def thinker_run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """The DAG up to tokenize on the model that opens its own reasoning (deepseek_r1 parser)."""
    return _run(
        tmp_path_factory, "own-thinker", "thinker", ("tokenize",), reasoning_parser="deepseek_r1"
    )
