"""The tiny-dsv3 verifier (verifier/tiny_kimi.py): Kimi-K2.5's nesting around a DeepSeek-V3
(MLA + MoE) text model.

These check what every stage relies on: the config is nested as Kimi-K2.5's is and carries what
vLLM on CPU needs, the project's readers see the text model through the wrapper, transformers
loads the checkpoint as built, and aux id 0 is refused before vLLM starts. vLLM's hidden states
against transformers': tests/integration/test_verifier_dsv3.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tiny_dsv3_case import AUX_IDS, N_LAYERS, load_hf
from verifiers import REPO

from eagle3_pipeline.evaluation import offline as acceptance
from eagle3_pipeline.verifier import identity as vf
from eagle3_pipeline.verifier import loading


@pytest.fixture(scope="module")
def verifier(tiny_dsv3_verifier_dir: Path) -> Path:
    return tiny_dsv3_verifier_dir


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


def test_id_zero_is_refused_before_vllm_starts(verifier: Path) -> None:
    """vLLM's DeepSeek model crashes on aux id 0 (no residual yet); the stage says so first."""
    from eagle3_pipeline.core.errors import VerifierError
    from eagle3_pipeline.serving import hidden_states as vllm_extract

    model_type = vf.text_config(vf.read_config(verifier))["model_type"]
    with pytest.raises(VerifierError, match="contains 0.*deepseek_v3"):
        vllm_extract.check_layer_ids(model_type, [0, 1, 2, N_LAYERS])
    vllm_extract.check_layer_ids(model_type, [*AUX_IDS, N_LAYERS])
