"""vLLM on CPU serves an MLA verifier with a flat Llama-architecture EAGLE-3 drafter, and the
seeds' failure in miniature: the drafter's aux layer ids shifted by one (a SpecForge-convention
checkpoint read in vLLM's convention) must fire evaluate's MISMATCH alarm.

The drafter is built, not trained, so that its drafts depend on which layer it reads: the
verifier's last decoder layer is made an identity (o_proj and every down_proj zero), so the
residual stream entering it (id N-1) IS the final pre-norm state (id N); the drafter's fc passes
that id's slice through, its decoder layer adds nothing, and its norm and lm_head are the
verifier's: it drafts the verifier's greedy token for the position it reads. (EAGLE drafts the
token after that one, so such drafts are accepted where the random verifier repeats itself,
which it often does: offline ~3.2, served ~2.5 here.) Read at ids shifted by one, the slice is
the state entering layer N-2, and the drafts are wrong. The offline simulation of the pipeline
(on transformers' hidden states at the right ids) is the reference evaluate compares with.

Beside them the same servers prove that vLLM serves a DFlash drafter next to MLA attention
(docs/families.md): the one a `dflash` families branch starts from on this verifier, built by
speculators' own `build_draft_model` (`training.run.initial_drafter`), served with `method:
dflash`. Untrained, it drafts and is almost never accepted; the test proves that vLLM loads and
runs it there, and that greedy outputs stay the verifier's own.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from builders import model_files
from drafter_fixtures import build_drafter, save_legacy_flat
from safetensors.torch import load_file, save_file
from train_workspace import tiny_settings
from verifiers import mla_server_spec

from eagle3_pipeline.config.families import FamilyParams
from eagle3_pipeline.config.params import Params
from eagle3_pipeline.core.errors import ServerError
from eagle3_pipeline.evaluation import offline, paired
from eagle3_pipeline.evaluation import online as oe
from eagle3_pipeline.evaluation import verdict as rules
from eagle3_pipeline.serving.served_with import check_aux_layers
from eagle3_pipeline.serving.server import ServerSpec, serve_many
from eagle3_pipeline.training.run import initial_drafter
from eagle3_pipeline.verifier import tiny as verifier_stage

REPO = Path(__file__).resolve().parents[2]
N_LAYERS = 5
AUX = [2, 3, 4]  # id 4 enters the identity layer 4: equal to id 5, the final state
SHIFTED = [a - 1 for a in AUX]  # SpecForge's "output of layer k" ids read as vLLM's inputs
K = 3
PROMPTS = [
    "What is the capital of Ghana?",
    "How do plants make food?",
    "Why is the sky blue?",
    "Name three rivers in Europe.",
]
# No paired rounds: this test judges acceptance and the alarm, not the speed-up (the rounds'
# logic is tested in test_evaluate_online.py); each round is two timed passes per concurrency
# on the slow MLA CPU path.
SETTINGS = oe.Settings(
    num_speculative_tokens=K, max_new_tokens=64, chat_template_kwargs={}, speedup_rounds=0
)
CONVERSATIONS = [[{"role": "user", "content": p}] for p in PROMPTS]
# The DFlash drafter's pass: block 4 drafts 3 tokens per pass.
DFLASH_PROMPTS = ["Why is the sky blue?", "Name three rivers in Europe."]
DFLASH_SETTINGS = oe.Settings(num_speculative_tokens=K, max_new_tokens=48, chat_template_kwargs={})
PARAMS = Params.model_validate({"evaluate": {"online": True, "mismatch_ratio": 0.5}})


@pytest.fixture(scope="module")
def verifier(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Kimi-like DeepSeek-V3 verifier (MLA + MoE) whose last layer is an identity."""
    out = tmp_path_factory.mktemp("mla") / "verifier"
    out.mkdir()
    tiny = {
        "architecture": "deepseek_v3",
        "corpus": str(REPO / "data/corpus/verifier_corpus.jsonl"),
        "train_steps": 0,  # random weights: varied greedy text; a wrong layer misses
        "vocab_size": 1024,
        "num_hidden_layers": N_LAYERS,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "train_batch_size": 4,
        "train_seq_len": 64,
    }
    layers = {"aux_layer_ids": AUX, "final_layer_id": N_LAYERS}
    params = Params.model_validate({"verifier": {"tiny": tiny}, "layers": layers})
    verifier_stage.build_tiny(params.verifier.tiny, params.seed, out)
    weights = load_file(out / "model.safetensors")
    last = f"language_model.model.layers.{N_LAYERS - 1}."
    zeroed = [
        k
        for k in weights
        if k.startswith(last) and k.endswith(("o_proj.weight", "down_proj.weight"))
    ]
    assert len(zeroed) >= 3  # attention, routed experts, shared expert
    for key in zeroed:
        weights[key] = torch.zeros_like(weights[key])
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out


def _copying_drafter(verifier: Path):
    """A speculators drafter whose first draft is the verifier's own greedy token."""
    vocab = int(load_file(verifier / "model.safetensors")["language_model.lm_head.weight"].shape[0])
    model = build_drafter(
        verifier, list(range(vocab)), AUX, seed=0, random_head=False, perturb_norms=False
    )
    norm = load_file(verifier / "model.safetensors")["language_model.model.norm.weight"]
    hidden = norm.shape[0]
    with torch.no_grad():
        model.fc.weight.zero_()
        model.fc.weight[:, 2 * hidden :] = torch.eye(hidden)  # the slice of the last aux id
        layer = model.layers[0]
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
        model.norm.weight.copy_(norm)
    return model


@pytest.fixture(scope="module")
def drafters(verifier: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Flat `LlamaForCausalLMEagle3` checkpoints (as the kimi profile serves): the right ids,
    and the ids a SpecForge checkpoint of the same drafter would carry."""
    root = tmp_path_factory.mktemp("flat")
    model = _copying_drafter(verifier)
    return {
        "right": _save_flat_fp32(model, root / "right", AUX),
        "shifted": _save_flat_fp32(model, root / "shifted", SHIFTED),
        "model": model,
        "dflash": _dflash_drafter(verifier, tmp_path_factory.mktemp("dflash")),
    }


def _dflash_drafter(verifier: Path, root: Path) -> Path:
    """An untrained DFlash drafter over the full vocab, reading vLLM's ids [1, 2] (id 0, the
    embeddings, vLLM cannot capture on DeepSeek-V3 models)."""
    vocab = int(load_file(verifier / "model.safetensors")["language_model.lm_head.weight"].shape[0])
    np.save(root / "t2d.npy", np.ones(vocab, dtype=bool))
    np.save(root / "d2t.npy", np.zeros(vocab, dtype=np.int64))
    settings = tiny_settings(  # data_dir is not read: nothing is trained
        {"root": root},
        root,
        verifier_dir=verifier,
        draft_vocab_size=vocab,
        target_layer_ids=[1, 2],
        family=FamilyParams(name="dflash", block_size=K + 1, num_layers=1, mask_token_id=1),
        mask_token_id=1,
    )
    model = initial_drafter(settings)
    assert type(model).__name__ == "DFlashDraftModel"
    model.save_pretrained(root / "drafter")
    return root / "drafter"


def _save_flat_fp32(model, out: Path, aux: list[int]) -> Path:
    """save_legacy_flat's layout with the fp32 weights: random logits tie often, and bf16
    rounding alone would move which token the drafter copies."""
    save_legacy_flat(model, out, aux)
    flat = load_file(out / "model.safetensors")
    state = {k.replace("layers.0.", "midlayer."): v for k, v in model.state_dict().items()}
    save_file({k: state[k].contiguous() for k in flat}, out / "model.safetensors")
    config = json.loads((out / "config.json").read_text())
    model_files(out, config=config | {"dtype": "float32"})
    return out


def _offline_mal(verifier: Path, model, runs: oe.RunResult) -> tuple[dict, dict]:
    """The pipeline's offline simulation on transformers' hidden states at the right ids: every
    start of the served answers, and vLLM's own walk through them (offline_same_prompts)."""
    from transformers import AutoTokenizer
    from transformers.models.kimi_k25 import Kimi_K25ForConditionalGeneration

    tok = AutoTokenizer.from_pretrained(verifier)
    hf = Kimi_K25ForConditionalGeneration.from_pretrained(verifier, dtype=torch.float32).eval()
    head = offline.VerifierHead(verifier, float(hf.config.text_config.rms_norm_eps))
    counts, walked = offline.AcceptanceCounts(K), offline.AcceptanceCounts(K)
    for conv, generated in zip(CONVERSATIONS, runs.token_ids, strict=True):
        prompt = tok.apply_chat_template(
            conv, add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
        ids = torch.tensor(list(prompt) + list(generated))
        with torch.no_grad():
            states = hf(input_ids=ids[None], output_hidden_states=True).hidden_states
        # id N (pre-norm final) = id N-1 here: the last layer is an identity
        hs = torch.stack([states[a][0] for a in AUX] + [states[N_LAYERS - 1][0]], dim=1)
        mask = torch.zeros(len(ids), dtype=torch.long)
        mask[len(prompt) :] = 1
        greedy = head.greedy(hs[:, -1])
        ok = offline.draft_matches(model, hs, ids, greedy, K)
        counts.add(offline.accepted_prefix(ok, mask))
        walked.add(offline.served_walk(ok, mask, SETTINGS.max_new_tokens))
    return counts.summary(), walked.summary()


@pytest.fixture(scope="module")
def served(verifier: Path, drafters: dict, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The baseline and the three drafters' servers, started at once (start-up is mostly
    single-threaded imports) and measured one at a time."""
    logs = tmp_path_factory.mktemp("logs")
    base = mla_server_spec(verifier, logs / "vllm.log")
    baseline_spec, right_spec = oe.server_specs(base, drafters["right"], K, logs / "right")
    _, shifted_spec = oe.server_specs(base, drafters["shifted"], K, logs / "shifted")
    _, dflash_spec = oe.server_specs(base, drafters["dflash"], K, logs / "dflash", family="dflash")
    runs: dict[str, oe.RunResult] = {}
    with serve_many([baseline_spec, right_spec, shifted_spec, dflash_spec]) as urls:
        url = dict(zip(("baseline", "right", "shifted", "dflash"), urls, strict=True))

        def runner(spec: ServerSpec, conversations: list, settings: oe.Settings) -> oe.RunResult:
            """evaluate's two runs, on the servers started for exactly the specs it asks for."""
            name = "right" if spec.speculative_config else "baseline"
            assert spec == {"right": right_spec, "baseline": baseline_spec}[name], spec
            run = oe.measure(url[name], conversations, settings)
            runs.setdefault(name, run)  # the full pass; the paired rounds' subsets follow
            return run

        right, _, right_verdict = oe.evaluate(
            base, drafters["right"], CONVERSATIONS, SETTINGS, logs / "right", runner
        )
        shifted_run = oe.measure(url["shifted"], CONVERSATIONS, SETTINGS)
        dflash_convs = [[{"role": "user", "content": p}] for p in DFLASH_PROMPTS]
        dflash = {
            "baseline": oe.measure(url["baseline"], dflash_convs, DFLASH_SETTINGS),
            "drafted": oe.measure(url["dflash"], dflash_convs, DFLASH_SETTINGS),
        }
    return {
        "dflash": dflash | {"log": dflash_spec.log_file, "drafter": drafters["dflash"]},
        "right": right,
        "right_verdict": right_verdict,
        "shifted": oe.online_section(runs["baseline"], shifted_run, K),
        "shifted_verdict": paired.verdict(
            [str(i) for i in range(len(PROMPTS))], runs["baseline"], shifted_run, SETTINGS
        ),
        "offline_summary": (sims := _offline_mal(verifier, drafters["model"], runs["baseline"]))[0],
        "offline": sims[0]["mean_acceptance_length"],
        "offline_same": sims[1],
        "logs": {"right": right_spec.log_file, "shifted": shifted_spec.log_file},
    }


@pytest.mark.vllm
def test_flat_drafter_served_beside_mla_verifier_raises_no_alarm(served: dict, capsys) -> None:
    right, offline_mal = served["right"], served["offline"]
    assert offline_mal > 1.8, offline_mal  # the drafter copies the verifier's next token
    assert right["num_drafts"] > 0
    # a few dozen drafts: the coarse rule first (served gain against the every-start figure)
    assert right["mean_acceptance_length"] > 1 + 0.5 * (offline_mal - 1), (
        right["acceptance_per_position"],
        served["offline_summary"]["acceptance_per_position"],
    )
    same = served["offline_same"]
    out = rules.online_verdict(
        right, offline_mal, [], PARAMS.evaluate, served["right_verdict"], same
    )
    assert out["mismatch"] is False and out["lossless"]["verdict"] != "diverged"
    # Like for like, the walk through the served answers: they stop at max_tokens, where vLLM
    # still verifies the last drafts (counted as rejected here), so vLLM may be the higher, by at
    # most one draft per prompt (lower only if a near tie flips a token).
    gap = out["mismatch_rule"]["relative_gap"]
    assert out["mismatch_rule"]["compared_with"] == "offline_same_prompts"
    assert -0.03 < gap < K * len(PROMPTS) / same["num_accepted_tokens"], (same, right)
    with capsys.disabled():  # the figures, for the log
        print(
            f"MLA: vLLM {right['mean_acceptance_length']:.4f} {right['acceptance_per_position']}, "
            f"walked {same['mean_acceptance_length']:.4f} {same['acceptance_per_position']} over "
            f"{same['num_drafts']} drafts (vLLM {right['num_drafts']}), every start "
            f"{offline_mal:.3f}"
        )
    # vLLM's own log names the layers it captured: the ones the drafter was built to read.
    assert check_aux_layers(served["logs"]["right"], AUX, Path("d"), "evaluate") == AUX
    assert "MISMATCH" not in capsys.readouterr().out


@pytest.mark.vllm
def test_shifted_aux_ids_fire_the_mismatch_alarm(served: dict, capsys) -> None:
    shifted, offline_mal = served["shifted"], served["offline"]
    assert shifted["num_drafts"] > 0
    assert shifted["mean_acceptance_length"] < 1 + 0.5 * (offline_mal - 1), shifted
    same = served["offline_same"]
    out = rules.online_verdict(
        shifted, offline_mal, [], PARAMS.evaluate, served["shifted_verdict"], same
    )
    assert (
        out["mismatch"] is True and out["mismatch_rule"]["compared_with"] == "offline_same_prompts"
    )
    # Named outright, before any acceptance figure: vLLM captured layers one below the trained.
    with pytest.raises(ServerError, match=rf"captured verifier layers \[{SHIFTED[0]}, "):
        check_aux_layers(served["logs"]["shifted"], AUX, Path("d"), "evaluate")
    lines = [x for x in capsys.readouterr().out.splitlines() if "MISMATCH" in x]
    assert len(lines) == 1 and "aux/final layer ids" in lines[0]
    # the verifier still decides every token: wrong drafts cost speed, not output
    assert out["lossless"]["verdict"] != "diverged"


@pytest.mark.vllm
def test_dflash_drafter_served_beside_mla_verifier_is_lossless(served: dict) -> None:
    dflash = served["dflash"]
    log = dflash["log"].read_text()
    assert "Resolved architecture: DFlashDraftModel" in log
    assert (
        f"SpeculativeConfig(method='dflash', model='{dflash['drafter']}', num_spec_tokens={K})"
        in log
    )
    section = oe.online_section(dflash["baseline"], dflash["drafted"], K)
    assert section["num_drafts"] > 0, section
    assert section["num_draft_tokens"] == K * section["num_drafts"], section
    verdict = paired.verdict(
        [str(i) for i in range(len(DFLASH_PROMPTS))],
        dflash["baseline"],
        dflash["drafted"],
        DFLASH_SETTINGS,
    )
    assert verdict.outcome == "identical", verdict
