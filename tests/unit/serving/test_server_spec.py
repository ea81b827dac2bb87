"""serving/server_spec.py: one verifier spec from params, and every vLLM start uses it.

The verifier here is a multimodal wrapper with custom code pinned at a hub revision: each start
(generate's server, extract's engine, evaluate's servers without and with the drafter) must
load that revision, with remote code, text-only.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
from builders import fake_verifier, make_params, pretrained
from online_runs import fake_run, write_val_prompts

from eagle3_pipeline.config.params import Params
from eagle3_pipeline.evaluation import online as oe
from eagle3_pipeline.serving import hidden_states
from eagle3_pipeline.serving import server as vllm_server
from eagle3_pipeline.serving.server import ServerSpec, command
from eagle3_pipeline.serving.server_spec import model_args, verifier_spec
from eagle3_pipeline.stages import evaluate, generate
from eagle3_pipeline.verifier.identity import read_verifier

REVISION = "0123abcd"
PINNED_FLAGS = ["--trust-remote-code", "--language-model-only", "--revision", REVISION]


# What every test here pins besides the verifier: its layers, the engine, two eval prompts.
PINNED = {
    "layers": {"aux_layer_ids": [1, 2, 3], "final_layer_id": 4},
    "vllm": {"max_model_len": 512, "enforce_eager": False},
    "evaluate": {"online": True, "max_eval_prompts": 2},
}


@pytest.fixture
def verifier(tmp_path: Path) -> Path:
    """Kimi-K2.5's shape: the text model nested under a wrapper with auto_map."""
    config = {
        "model_type": "kimi_k25",
        "auto_map": {"AutoConfig": "configuration_kimi.KimiConfig"},
        "text_config": {
            "model_type": "deepseek_v3",
            "num_hidden_layers": 4,
            "hidden_size": 64,
            "vocab_size": 300,
        },
    }
    return fake_verifier(tmp_path / "verifier", config)


def _pinned(verifier: Path, **vllm: object) -> Params:
    return make_params(
        PINNED,
        verifier=pretrained(verifier, revision=REVISION, trust_remote_code=True),
        vllm=vllm,
    )


def _flags(spec: ServerSpec) -> list[str]:
    return command(spec, port=8000)


def _carries_pinned_verifier(spec: ServerSpec, verifier: Path) -> None:
    flags = _flags(spec)
    assert flags[flags.index("--model") + 1] == str(verifier)
    for flag in PINNED_FLAGS:
        assert flag in flags, (flag, flags)
    assert flags[flags.index("--revision") + 1] == REVISION


def test_spec_carries_pinned(verifier: Path, tmp_path: Path) -> None:
    params = _pinned(verifier, extra_args=["--max-num-seqs", "4"], tensor_parallel_size=2)
    facts = read_verifier(params.verifier)
    spec = verifier_spec(facts, params.vllm, tmp_path / "x.log", reasoning_parser="deepseek_r1")
    assert spec.model == str(verifier) and spec.log_file == tmp_path / "x.log"
    assert spec.revision == REVISION and spec.trust_remote_code and spec.language_model_only
    assert spec.max_model_len == 512 and spec.enforce_eager is False
    assert spec.tensor_parallel_size == 2 and spec.dtype is None
    assert spec.served_model_name == "verifier" and spec.reasoning_parser == "deepseek_r1"
    assert spec.ready_timeout_s == params.vllm.ready_timeout_s
    flags = _flags(spec)
    # Revision just before extra_args: generate's command line is the one it always was.
    assert flags[-6:] == [*PINNED_FLAGS, "--max-num-seqs", "4"]
    assert "--enforce-eager" not in flags and "--dtype" not in flags
    assert _flags(verifier_spec(facts, params.vllm, tmp_path / "x.log", dtype="float32"))[
        -4:-2
    ] == [
        "--dtype",
        "float32",
    ]


def test_plain_verifier_adds_no_flags(tmp_path: Path) -> None:
    """No revision, no remote code, no multimodal wrapper: none of the flags."""
    plain = {"model_type": "llama", "num_hidden_layers": 4, "hidden_size": 64, "vocab_size": 300}
    params = make_params(verifier=pretrained(fake_verifier(tmp_path / "verifier", plain)))
    flags = _flags(verifier_spec(read_verifier(params.verifier), params.vllm, tmp_path / "x.log"))
    for flag in (*PINNED_FLAGS[:3], "--dtype"):
        assert flag not in flags
    assert "--enforce-eager" in flags


def test_every_vllm_start_loads_the_pinned_verifier(
    verifier: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    params = _pinned(verifier)
    starts: dict[str, ServerSpec] = {}

    @contextlib.contextmanager
    def fake_serve(spec: ServerSpec):
        starts["generate"] = spec
        yield "http://127.0.0.1:1"

    monkeypatch.setattr(vllm_server, "serve", fake_serve)
    facts = read_verifier(params.verifier)
    with generate._servers(params, facts):  # one on loopback (cluster.engine: local)
        pass

    def fake_measure(spec: ServerSpec, conversations: list, settings: oe.Settings):
        drafts = 2 if spec.speculative_config else 0
        return fake_run([[1]] * 2, wall=1.0, drafts=drafts, accepted=drafts)

    @contextlib.contextmanager
    def fake_servers_up(specs: list[ServerSpec], together: bool):
        for spec in specs:
            name = "with drafter" if spec.speculative_config else "baseline"
            starts[f"evaluate {name}"] = spec
        yield fake_measure

    monkeypatch.chdir(tmp_path)
    write_val_prompts(tmp_path)
    monkeypatch.setattr(oe, "servers_up", fake_servers_up)
    evaluate.run_online(params)

    assert sorted(starts) == ["evaluate baseline", "evaluate with drafter", "generate"]
    for spec in starts.values():
        _carries_pinned_verifier(spec, verifier)

    # extract's in-process engine (the connector is vLLM's business, not this test's)
    monkeypatch.setattr(hidden_states, "connector_config", lambda storage_dir: {})
    engine = hidden_states.ExtractionEngine(
        facts, params.vllm, params.extract.max_tokens_per_batch, params.seed
    )
    kw = hidden_states.engine_kwargs(engine, [1, 2, 3, 4], tmp_path / "hs")
    assert kw["revision"] == REVISION
    assert kw["trust_remote_code"] is True and kw["language_model_only"] is True
    assert kw["dtype"] == "auto"  # the checkpoint names none
    shared = {k: v for k, v in model_args(facts, params.vllm).items() if k != "dtype"}
    assert {k: kw[k] for k in shared} == shared
    for spec in starts.values():
        assert {k: getattr(spec, k) for k in shared} == shared
