"""Shared fixtures; tests/helpers/ (builders and workspaces the tests share) is importable."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests/helpers"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("DVC_NO_ANALYTICS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One vLLM cache for every server and engine the tests start, in this checkout's scratch folder
# (where a server started from the repo root keeps it): vLLM inspects each model architecture
# once (a subprocess importing torch and vLLM, ~18 s on 2 cores) and reuses the result after,
# instead of once in every temp workspace and every pipeline copy.
os.environ.setdefault("VLLM_CACHE_ROOT", str(REPO / "data/.work/vllm-cache"))
# Torch's OpenMP threads sleep, not spin, while they wait at a barrier; the same threads split the
# same work, so results do not change. Spinning threads of the tiny models' many small ops starve
# every other busy process on 2 cores, and themselves with it: building the e2e verifier (150
# steps) took 200 s instead of 32 s, same bytes, while other tests ran on the machine.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


from own_verifier_runs import own_run, thinker_run  # noqa: E402
from pipeline_repo import (  # noqa: E402
    LANE,
    ONLINE_RUN,
    TINY_RUN,
    Run,
    online_pipeline,
    tiny_pipeline,
)
from verifiers import build_tiny_dsv3_verifier, build_tiny_verifier  # noqa: E402

# The pipeline runs the session shares (tests/e2e): the helper a test module imports to wait for
# one, and the run, in the order the background lane does them (the main DAG first: the tests of
# its modules take longest after it).
SHARED_RUNS: list[tuple[Callable, Callable[[pytest.TempPathFactory], Run]]] = [
    (tiny_pipeline, lambda tmp_path_factory: TINY_RUN),
    (online_pipeline, lambda tmp_path_factory: ONLINE_RUN),
    (thinker_run, thinker_run),
    (own_run, own_run),
]


def _runs(item: pytest.Item) -> set[int]:
    """The shared runs (indices of SHARED_RUNS) the test's module asks for."""
    module = getattr(item, "module", None)
    return {i for i, (f, _) in enumerate(SHARED_RUNS) if getattr(module, f.__name__, None) is f}


@pytest.hookimpl(trylast=True)  # after -k/-m deselection: only the selected tests count
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Modules that wait for a shared pipeline run go last, in the lane's order (a module that
    waits for several, after the last of them), so that the runs (started with the session, one
    after another) go on beside the other tests."""
    position = {item.path: max(_runs(item)) for item in items if _runs(item)}
    items.sort(key=lambda item: (item.path in position, position.get(item.path, 0)))


@pytest.fixture(scope="session", autouse=True)
def pipeline_runs_in_background(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[None]:
    """Start the shared pipeline runs that the selected tests' modules wait for, in a background
    lane (pipeline_repo.Lane); end whatever is still running when the session ends."""
    needed = set().union(*(_runs(item) for item in request.session.items))
    if needed:
        LANE.start(tmp_path_factory, [SHARED_RUNS[i][1](tmp_path_factory) for i in sorted(needed)])
    yield
    LANE.stop()  # also a run that only a deselected or never reached test needed


@pytest.fixture(scope="session")
def tiny_verifier_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shared seeded verifier (5 training steps), servable by vLLM on CPU."""
    return build_tiny_verifier(tmp_path_factory.mktemp("verifier") / "verifier")


@pytest.fixture(scope="session")
def generate_server(
    tiny_verifier_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """One real vLLM server of the shared verifier, started as `generate` starts its own (its
    spec: generate.server_spec), for the modules that run generate against a given server
    (tests/integration: test_generate_vllm.py, test_server_down.py): one start (~17 s of CPU on
    2 cores) instead of one per module. Sampling is per request, so each module asks its own;
    no process of it outlives the session (checked at its end)."""
    import uuid

    from generate_workspace import vllm_params
    from server_procs import TAG_VAR, wait_none_tagged

    from eagle3_pipeline.serving import server as vllm_server
    from eagle3_pipeline.stages import generate
    from eagle3_pipeline.verifier.identity import read_verifier

    tag = uuid.uuid4().hex
    params = vllm_params(tiny_verifier_dir)
    spec = generate.server_spec(params, read_verifier(params.verifier))
    spec.log_file = tmp_path_factory.mktemp("generate-server") / "server.log"
    spec.env = {TAG_VAR: tag}
    with vllm_server.serve(spec) as url:
        yield url
    assert wait_none_tagged(tag) == [], "the server outlived its `with` block"


@pytest.fixture(scope="session")
def tiny_dsv3_verifier_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny-dsv3 verifier (Kimi-K2.5's nesting around a DeepSeek-V3 MLA + MoE text model),
    built once for its unit tests and its vLLM test."""
    return build_tiny_dsv3_verifier(tmp_path_factory.mktemp("dsv3") / "verifier")
