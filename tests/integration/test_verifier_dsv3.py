"""The tiny-dsv3 verifier: Kimi-K2.5's nesting around a DeepSeek-V3 (MLA + MoE) text model.

The fast tests check what every stage relies on: the config is nested as Kimi-K2.5's is and
carries what vLLM on CPU needs, the project's readers see the text model through the wrapper,
and transformers loads the checkpoint as built. The vLLM test runs the real extract stage with
both backends and compares the stores layer for layer, as tests/test_extract_vllm.py does for
Llama, plus the check that id N is the last layer's output before the norm.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from extract_fixtures import extract_params
from extract_fixtures import write_tokenized as shared_write_tokenized
from verifiers import REPO, build_tiny_dsv3_verifier

from eagle3_pipeline.evaluation import offline as acceptance
from eagle3_pipeline.params import Params
from eagle3_pipeline.stages import extract
from eagle3_pipeline.store import format as store
from eagle3_pipeline.verifier import identity as vf
from eagle3_pipeline.verifier import loading

N_LAYERS = 3
AUX_IDS = [2, 1]  # out of order: vLLM returns them ascending (id 0: see the test below)
LENGTHS = {"train": [9, 30, 57], "val": [21]}


@pytest.fixture(scope="module")
def verifier(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_dsv3_verifier(tmp_path_factory.mktemp("dsv3") / "verifier")


def load_hf(verifier: Path):
    params = Params.model_validate({"verifier": {"source": "pretrained", "path": str(verifier)}})
    return loading.load_model(params)


def test_config_is_nested_like_kimi_k25(verifier: Path) -> None:
    config = json.loads((verifier / "config.json").read_text())
    kimi = json.loads((REPO / "tests/fixtures/kimi-k2.5/config.json").read_text())
    assert config["architectures"] == kimi["architectures"] == ["KimiK25ForConditionalGeneration"]
    assert config["model_type"] == kimi["model_type"] == "kimi_k25"
    assert "auto_map" not in config  # transformers' and vLLM's own classes: no remote code
    text = config["text_config"]
    assert text["model_type"] == kimi["text_config"]["model_type"] == "deepseek_v3"
    assert text["kv_lora_rank"] + text["qk_rope_head_dim"] == 576  # vLLM's CPU MLA kernel
    assert text["topk_method"] == "noaux_tc" and text["scoring_func"] == "sigmoid"
    assert text["n_routed_experts"] > text["num_experts_per_tok"] >= 1
    assert text["first_k_dense_replace"] == 1 and text["n_shared_experts"] == 1
    assert vf.is_multimodal_wrapper(config) and not vf.needs_remote_code(config)
    assert vf.shape(config) == (N_LAYERS, 64, text["vocab_size"])
    assert (verifier / "preprocessor_config.json").is_file()  # vLLM's Kimi processor reads it
    assert config["media_placeholder_token_id"] == config["image_token_id"]  # vLLM EAGLE-3 reads it


def test_tokenizer_has_thinking_tokens_and_template(verifier: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(verifier)
    for special in ("<think>", "</think>"):
        assert len(tok(special, add_special_tokens=False)["input_ids"]) == 1
    messages = [{"role": "user", "content": "hi"}]
    on = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    off = tok.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, thinking=False
    )
    assert on.endswith("<think>") and off.endswith("<think></think>")


def test_checkpoint_uses_hub_names_and_head_matches_model(verifier: Path) -> None:
    """Weights carry Kimi-K2.5's hub names (what vLLM loads); the offline simulation's head,
    found by suffix, gives the model's own greedy tokens."""
    from safetensors import safe_open

    with safe_open(str(verifier / "model.safetensors"), framework="pt") as fh:
        keys = set(fh.keys())
    assert "language_model.lm_head.weight" in keys
    assert "language_model.model.norm.weight" in keys
    assert f"language_model.model.layers.{N_LAYERS - 1}.mlp.gate.e_score_correction_bias" in keys
    assert not any(".blocks." in k for k in keys if k.startswith("language_model."))

    model = load_hf(verifier)
    assert len(loading.decoder_layers(model)) == N_LAYERS
    ids = torch.arange(10, 50).unsqueeze(0)
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True)
    final = out.hidden_states[N_LAYERS][0]  # after the norm in transformers 5 ...
    pre_norm = loading.decoder_layers(model)[-1]
    captured: list[torch.Tensor] = []
    handle = pre_norm.register_forward_hook(lambda _m, _a, o: captured.append(o))
    with torch.no_grad():
        model(input_ids=ids)
    handle.remove()
    text_cfg = vf.text_config(vf.read_config(verifier))
    head = acceptance.VerifierHead(verifier, float(text_cfg["rms_norm_eps"]))
    assert torch.equal(head.greedy(captured[0][0]), out.logits[0].argmax(-1))
    assert not torch.allclose(captured[0][0], final)  # ... so the store takes the hook's


# --- hf vs vLLM hidden states --------------------------------------------------------------


def test_id_zero_is_refused_before_vllm_starts(verifier: Path) -> None:
    """vLLM's DeepSeek model crashes on aux id 0 (no residual yet); the stage says so first."""
    from eagle3_pipeline.errors import VerifierError
    from eagle3_pipeline.serving import hidden_states as vllm_extract

    with pytest.raises(VerifierError, match="contains 0.*deepseek_v3"):
        vllm_extract.check_layer_ids(vf.read_config(verifier), [0, 1, 2, N_LAYERS])
    vllm_extract.check_layer_ids(vf.read_config(verifier), [*AUX_IDS, N_LAYERS])


def make_params(verifier: Path, backend: str) -> Params:
    params = extract_params(verifier, backend, AUX_IDS, N_LAYERS, max_tokens_per_batch=120)
    # The fp32 verifier on a CPU with AMX: vLLM would pick AMX_MLA, which takes bf16 weights
    # only (profiles/tiny-dsv3.yaml asks for CPU_MLA the same way).
    vllm = params.vllm.model_copy(update={"extra_args": ["--attention-backend", "CPU_MLA"]})
    return params.model_copy(update={"vllm": vllm})


def write_tokenized(root: Path, vocab_size: int) -> dict[str, list[int]]:
    return shared_write_tokenized(root, LENGTHS, vocab_size, prompt_tokens=1)


def read_store(root: Path) -> tuple[dict, dict[str, dict[str, torch.Tensor]]]:
    manifest = store.read_manifest(root)
    return manifest, {s: store.read_sample(root, e) for s, e in manifest["samples"].items()}


@pytest.mark.vllm
def test_vllm_hidden_states_match_hf_on_dsv3(verifier, tmp_path, monkeypatch) -> None:
    """vLLM serves the wrapper text-only (--language-model-only) and its extract_hidden_states
    stores what the transformers hooks store, for every id including N (pre-norm)."""
    monkeypatch.chdir(tmp_path)
    vocab = vf.shape(vf.read_config(verifier))[2]
    prompts = write_tokenized(tmp_path, vocab)
    extract.run(make_params(verifier, "hf"))
    Path("data/hidden_states").rename("hf_store")
    extract.run(make_params(verifier, "vllm"))

    ref_manifest, ref = read_store(Path("hf_store"))
    manifest, got = read_store(Path("data/hidden_states"))
    assert manifest["layer_ids"] == ref_manifest["layer_ids"] == [*AUX_IDS, N_LAYERS]
    assert manifest["num_samples"] == len(prompts)
    # vLLM's CPU MLA path is not bit-close to transformers' (measured here: per-token cosine
    # >= 0.9985, max diff <= 2.4% of the largest value, bf16 store on both sides), so the check
    # is per token plus one that fails on a shifted layer: each layer is nearest its own id.
    for sid, sample in got.items():
        assert sample["token_ids"].tolist() == prompts[sid] == ref[sid]["token_ids"].tolist()
        ids = manifest["layer_ids"]
        for j, lid in enumerate(ids):
            a = sample["hidden_states"][:, j].float()
            b = ref[sid]["hidden_states"][:, j].float()
            cos = torch.nn.functional.cosine_similarity(a, b, dim=-1)
            assert cos.min() > 0.995, f"{sid} layer {lid}: cosine {cos.min():.4f}"
            assert (a - b).abs().max() < 0.04 * b.abs().max(), f"{sid} layer {lid}"
            dists = [(a - ref[sid]["hidden_states"][:, k].float()).norm() for k in range(len(ids))]
            assert min(range(len(ids)), key=dists.__getitem__) == j, f"{sid} layer {lid}"

    model = load_hf(verifier)
    sid = max(prompts, key=lambda s: len(prompts[s]))
    with torch.no_grad():
        out = model(input_ids=torch.tensor([prompts[sid]]), output_hidden_states=True)
        final = got[sid]["hidden_states"][:, -1].float()
        logits = model.lm_head(model.model.language_model.norm(final))
    assert not torch.allclose(final, out.hidden_states[N_LAYERS][0], rtol=0.1, atol=0.1)
    torch.testing.assert_close(logits, out.logits[0], rtol=0.05, atol=0.05)
