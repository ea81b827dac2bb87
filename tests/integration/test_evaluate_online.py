"""Online evaluation against real vLLM servers (the stage's glue without vLLM:
tests/unit/stages/test_evaluate.py).

The module starts three servers at once (~40-90 s apiece on 2 cores; start-up is mostly
single-threaded imports, so together they take far less than in turn): a const pair that must
accept every draft, and an untrained drafter with and without speculation, which must accept
almost nothing and must not change the greedy output. They are measured one at a time (the
untrained pair once each in full, then in paired rounds, the order alternating) and stopped
before the fixture returns, so the last test can check that none of their processes survived.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from drafter_fixtures import build_drafter
from safetensors.torch import load_file, save_file
from server_procs import server_pids
from verifiers import build_tiny_verifier

from eagle3_pipeline.evaluation import online as oe
from eagle3_pipeline.serving.server import ServerSpec, serve_many

REPO = Path(__file__).resolve().parents[2]
K = 3
DRAFT_VOCAB = 256
AUX_IDS = [2, 4, 5]
PROMPTS = [
    "What is the sun made of?",
    "How should I store fresh herbs?",
    "A square garden has sides of 12 metres. What is its perimeter?",
    "What is an eclipse?",
    "Name three rivers in Europe.",
    "Why is the sky blue?",
]
SETTINGS = oe.Settings(
    num_speculative_tokens=K,
    max_new_tokens=24,
    concurrency=2,
    chat_template_kwargs={"thinking": True},
    request_timeout_s=600.0,
    speedup_rounds=2,  # both orders; the rounds' median and spread have unit tests
)
CONVERSATIONS = [[{"role": "user", "content": p}] for p in PROMPTS]

# Process group of every server this module started -> its live processes while it served
# (api_server, EngineCore, worker: vLLM keeps its children in the leader's group).
STARTED: dict[int, list[int]] = {}


# --- models ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served_verifier_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Random weights (0 training steps): varied greedy text, a harder identity check."""
    return build_tiny_verifier(tmp_path_factory.mktemp("served") / "verifier", train_steps=0)


def build_untrained_drafter(verifier: Path, out: Path, draft_vocab: int) -> Path:
    """An untrained EAGLE-3 drafter built and saved by speculators itself, as training would.

    The draft vocab is the first `draft_vocab` target ids (d2t all zero), so draft id 0 is
    target id 0, which the const pair relies on.
    """
    model = build_drafter(
        verifier,
        list(range(draft_vocab)),
        AUX_IDS,
        seed=0,
        random_head=False,
        perturb_norms=False,
        ttt_steps=K,
    )
    model.save_pretrained(out)
    return out


def zero_weight(src: Path, dst: Path, key: str) -> Path:
    """A copy of a model whose `key` (a final norm weight) is zero: all logits become 0, so
    greedy always picks token 0 (as /work/shared/reference/make_const_pair.py does)."""
    shutil.copytree(src, dst)
    weights = load_file(dst / "model.safetensors")
    weights[key] = torch.zeros_like(weights[key])
    save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def models(served_verifier_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("drafters")
    drafter = build_untrained_drafter(served_verifier_dir, root / "drafter", DRAFT_VOCAB)
    return {
        "verifier": served_verifier_dir,
        "drafter": drafter,
        "const_verifier": zero_weight(
            served_verifier_dir, root / "verifier-const", "model.norm.weight"
        ),
        "const_drafter": zero_weight(drafter, root / "drafter-const", "norm.weight"),
        "logs": root / "logs",
    }


# --- servers ---------------------------------------------------------------------------------


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, pgid) of a live process, from /proc (fields after the parenthesised name)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()
    return fields[0], int(fields[2])


def _group_members(pgids: set[int] | dict[int, Any]) -> list[int]:
    """Live (non-zombie) processes whose process group is one of `pgids`."""
    members = []
    for entry in Path("/proc").iterdir():
        stat = _proc_stat(int(entry.name)) if entry.name.isdigit() else None
        if stat is not None and stat[1] in pgids and stat[0] != "Z":
            members.append(int(entry.name))
    return members


def _server_pgid(url: str) -> int:
    """The process group of the server listening on the url's port."""
    pids = server_pids(int(url.rsplit(":", 1)[1]))
    assert pids, f"no vLLM server process found for {url}"
    return os.getpgid(pids[0])


def _base_spec(verifier: Path, logs: Path) -> ServerSpec:
    return ServerSpec(model=str(verifier), log_file=logs / "vllm.log", ready_timeout_s=900.0)


@pytest.fixture(scope="module")
def runs(models: dict) -> dict[str, Any]:
    """Every run of the module. The three servers start at once (start-up is mostly
    single-threaded imports; the stage starts its two so on CPU) and are measured one at a
    time; each one's process group is noted for the leak check. All are stopped when this
    returns."""
    logs = models["logs"]
    _, const_spec = oe.server_specs(
        _base_spec(models["const_verifier"], logs), models["const_drafter"], K, logs / "const"
    )
    base = _base_spec(models["verifier"], logs)
    baseline_spec, eagle_spec = oe.server_specs(base, models["drafter"], K, logs / "random")
    with serve_many([const_spec, baseline_spec, eagle_spec]) as urls:
        for url in urls:
            pgid = _server_pgid(url)
            STARTED[pgid] = _group_members({pgid})
        const_url, baseline_url, eagle_url = urls
        const = oe.measure(const_url, CONVERSATIONS, SETTINGS)
        measured: dict[str, oe.RunResult] = {}
        order: list[str] = []  # the servers of the paired rounds' runs, in order

        def runner(spec: ServerSpec, conversations: list, settings: oe.Settings) -> oe.RunResult:
            """evaluate's runs, on the servers started for exactly the specs it asks for: one
            full pass each (kept), then the paired rounds (no logprobs)."""
            name = "spec" if spec.speculative_config else "baseline"
            assert spec == {"spec": eagle_spec, "baseline": baseline_spec}[name], spec
            url = eagle_url if name == "spec" else baseline_url
            result = oe.measure(url, conversations, settings)
            if settings.top_logprobs:
                measured[name] = result
            else:
                order.append(name)
            return result

        section, differing, verdict = oe.evaluate(
            base, models["drafter"], CONVERSATIONS, SETTINGS, logs / "random", runner
        )
    return {"const": const, "random": (section, differing, measured, verdict), "order": order}


@pytest.fixture(scope="module")
def const_run(runs: dict) -> oe.RunResult:
    return runs["const"]


@pytest.fixture(scope="module")
def random_eval(runs: dict) -> tuple[dict[str, Any], list[int], dict[str, oe.RunResult], Any]:
    return runs["random"]


@pytest.mark.vllm
def test_const_pair_accepts_every_draft(const_run: oe.RunResult) -> None:
    result = oe.served_acceptance(const_run.counters, K)
    assert result["num_drafts"] > 0, const_run.counters
    assert result["acceptance_rate"] >= 0.95, result
    assert result["mean_acceptance_length"] >= 1 + 0.95 * K, result
    assert all(p >= 0.95 for p in result["acceptance_per_position"]), result
    assert const_run.output_tokens == len(PROMPTS) * SETTINGS.max_new_tokens


@pytest.mark.vllm
def test_random_drafter_accepts_almost_nothing(random_eval: tuple) -> None:
    section, _, _, _ = random_eval
    assert section["num_drafts"] > 0, section
    assert section["acceptance_rate"] <= 0.05, section
    assert section["mean_acceptance_length"] <= 1.15, section
    assert section["num_prompts"] == len(PROMPTS)
    assert section["tokens_per_s"] > 0 and section["tokens_per_s_baseline"] > 0
    assert len(section["speedup_rounds"]) == SETTINGS.speedup_rounds
    if section["speedup_trusted"]:  # the median round's own figures
        assert section["speedup"] == pytest.approx(
            section["tokens_per_s"] / section["tokens_per_s_baseline"]
        )
    else:  # this machine's speed changed during the rounds: said, no figure
        assert section["speedup"] is None, section
        assert section["speedup_spread"] > SETTINGS.speedup_max_spread, section


@pytest.mark.vllm
def test_paired_rounds_alternate_with_both_servers_up(runs: dict) -> None:
    pair = ["baseline", "spec", "spec", "baseline"]
    assert runs["order"] == (pair * SETTINGS.speedup_rounds)[: 2 * SETTINGS.speedup_rounds]


@pytest.mark.vllm
def test_greedy_outputs_identical_with_and_without_drafter(random_eval: tuple) -> None:
    _, differing, runs, verdict = random_eval
    baseline, spec = runs["baseline"], runs["spec"]
    assert baseline.output_tokens > len(PROMPTS) * 4, baseline.texts  # real outputs, not stubs
    assert len({tuple(t) for t in baseline.token_ids}) > 1, baseline.texts  # varied outputs
    assert differing == []
    assert baseline.token_ids == spec.token_ids
    assert baseline.texts == spec.texts
    assert spec.counters["num_drafts"] > 0 and baseline.counters["num_drafts"] == 0
    assert spec.counters["spec_decode_enabled"] and not baseline.counters["spec_decode_enabled"]
    assert spec.counters["generation_tokens"] == spec.output_tokens
    assert verdict.outcome == "identical" and verdict.passed
    # both runs carry top-k logprobs, token for token, and they agree on the chosen tokens
    for run in (baseline, spec):
        for ids, logprobs in zip(run.token_ids, run.logprobs, strict=True):
            assert [t.token_id for t in logprobs] == ids
            assert all(len(t.top) == SETTINGS.top_logprobs for t in logprobs)


@pytest.mark.vllm
def test_no_server_process_left_behind(const_run: oe.RunResult, random_eval: tuple) -> None:
    assert len(STARTED) == 3
    assert all(len(members) >= 3 for members in STARTED.values()), STARTED
    deadline = time.monotonic() + 30
    while (alive := _group_members(STARTED)) and time.monotonic() < deadline:
        time.sleep(1)
    assert alive == [], f"server processes still running: {alive}"
