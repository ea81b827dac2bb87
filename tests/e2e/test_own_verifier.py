"""A verifier the user brings: its own folder, a hub id as its name, offline, a foreign template.

The whole shrunken DAG runs with every hub download patched to raise (in DVC's stages and in
the vLLM servers they start), and `HF_HUB_OFFLINE=1`: the name is a label, the path is the model.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from offline_hub import MESSAGE, UNREACHABLE_HUB_ID
from own_verifier_runs import downloads, hubless_site, own_run, thinker_run
from pipeline_repo import repo_env, run_in, session_run

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def hubless(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return hubless_site(tmp_path_factory)


@pytest.fixture(scope="module")
def own(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The whole DAG, online evaluation included, on a ChatML model with a default system prompt."""
    repo = session_run(tmp_path_factory, own_run(tmp_path_factory))
    return repo, downloads(tmp_path_factory)["chatml"]


@pytest.fixture(scope="module")
def thinker(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The DAG up to tokenize on a model whose generation prompt leaves `<think>` to it."""
    repo = session_run(tmp_path_factory, thinker_run(tmp_path_factory))
    return repo, downloads(tmp_path_factory)["thinker"]


def test_the_guard_is_live(hubless: Path, tmp_path: Path) -> None:
    probe = (
        f"from transformers import AutoConfig; AutoConfig.from_pretrained({UNREACHABLE_HUB_ID!r})"
    )
    env = repo_env(None, hubless) | {"HF_HUB_OFFLINE": "0"}
    proc = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True)
    assert proc.returncode != 0 and MESSAGE in proc.stderr


def test_whole_dag_runs_offline(own: tuple[Path, Path]) -> None:
    repo, verifier = own
    ev = json.loads((repo / "metrics/eval.json").read_text())
    assert ev["online"]["num_drafts"] > 0 and not ev["mismatch"]
    # The cross-check holds on a model the pipeline did not build: within 10% on this small
    # sample (6 prompts x 24 tokens online; measured 3.33 online vs 3.58 offline, 7%).
    online, offline = ev["online"], ev["offline"]["trained"]
    gap = abs(online["mean_acceptance_length"] - offline["mean_acceptance_length"])
    assert gap / offline["mean_acceptance_length"] < 0.10
    assert offline["mean_acceptance_length"] > ev["offline"]["untrained"]["mean_acceptance_length"]
    summary = run_in(repo, sys.executable, "-m", "eagle3_pipeline.report.summary")
    assert "online (vLLM)" in summary


def test_drafter_records_name_and_path(own: tuple[Path, Path]) -> None:
    repo, verifier = own
    cfg = json.loads((repo / "models/drafter/config.json").read_text())
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == UNREACHABLE_HUB_ID
    record = cfg["eagle3_pipeline"]["verifier"]
    assert record["name_or_path"] == UNREACHABLE_HUB_ID and record["path"] == str(verifier)


def test_prompts_carry_the_templates_default_system_prompt(own: tuple[Path, Path]) -> None:
    from transformers import AutoTokenizer

    repo, verifier = own
    tok = AutoTokenizer.from_pretrained(str(verifier))
    row = json.loads((repo / "data/tokenized/train.jsonl").read_text().splitlines()[0])
    text = tok.decode(row["input_ids"])
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named Tiny.")
    gen = json.loads((repo / "data/generated/train.jsonl").read_text().splitlines()[0])
    assert gen["reasoning"] is None  # no reasoning parser: the whole reply is the answer


def test_model_that_opens_its_own_reasoning(thinker: tuple[Path, Path]) -> None:
    """The generation prompt stops before `<think>`; the model writes it, the parser strips it,
    and tokenize puts it back: the training sequence is the one the model produced."""
    from transformers import AutoTokenizer

    repo, verifier = thinker
    tok = AutoTokenizer.from_pretrained(str(verifier))
    think = tok.convert_tokens_to_ids("<think>")
    generated = {
        r["id"]: r
        for line in (repo / "data/generated/train.jsonl").read_text().splitlines()
        for r in [json.loads(line)]
    }
    opened = 0
    for line in (repo / "data/tokenized/train.jsonl").read_text().splitlines():
        row = json.loads(line)
        first = row["loss_mask"].index(1)
        if generated[row["id"]]["reasoning"] is not None:
            opened += 1
            assert row["input_ids"][first] == think
    assert opened > 0  # trained on `<think>...` chats, the model does open its reasoning
