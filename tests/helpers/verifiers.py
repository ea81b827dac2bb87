"""Tiny verifiers built by the real verifier stage, shrunk to seconds, for tests."""

from __future__ import annotations

import shutil
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def build_tiny_verifier(out: Path, **tiny: object) -> Path:
    """A small verifier built by the real verifier stage; `tiny` overrides its shape/training."""
    from eagle3_pipeline.config.params import Params
    from eagle3_pipeline.verifier import tiny as stage

    shape = {
        "train_steps": 5,
        "corpus": str(REPO / "data/corpus/verifier_corpus.jsonl"),
        "vocab_size": 1024,
        "hidden_size": 64,
        "intermediate_size": 128,
        # head_dim 32: vLLM's CPU attention rejects head_dim 16
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
    }
    params = Params.model_validate(
        {"verifier": {"tiny": shape | tiny}, "vocab": {"draft_vocab_size": 256}}
    )
    out.mkdir(parents=True)
    stage.build_tiny(params.verifier.tiny, params.seed, out)
    return out


def build_tiny_dsv3_verifier(out: Path, **tiny: object) -> Path:
    """A small Kimi-K2.5-like verifier (DeepSeek-V3 MLA + MoE under text_config), as the
    tiny-dsv3 profile builds it, shrunk to seconds: 3 layers, hidden 64, 5 tiny training steps."""
    from eagle3_pipeline.config.params import Params
    from eagle3_pipeline.verifier import tiny as stage

    shape = {
        "architecture": "deepseek_v3",
        "train_steps": 5,
        "corpus": str(REPO / "data/corpus/verifier_corpus.jsonl"),
        "vocab_size": 1024,
        "num_hidden_layers": 3,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 2,  # MLA head dims qk_nope = v = 32
        "num_key_value_heads": 2,
        "train_batch_size": 2,
        "train_seq_len": 32,
    }
    params = Params.model_validate(
        {
            "verifier": {"tiny": shape | tiny},
            "layers": {"aux_layer_ids": [0, 1, 2], "final_layer_id": 3},
            "vocab": {"draft_vocab_size": 256},
        }
    )
    out.mkdir(parents=True)
    stage.build_tiny(params.verifier.tiny, params.seed, out)
    return out


def build_pretrained_like(out: Path, template: str, **tiny: object) -> Path:
    """A verifier as a user downloads one: its own folder, tied embeddings, a chat template the
    pipeline did not write (tests/helpers/templates.py), no `<think>` in the prompt unless the
    template puts it there. Trained as the tiny profiles' verifier is, so its answers carry a
    signal; then only the template changes, as `save_pretrained` writes it."""
    build_tiny_verifier(out, **({"tie_word_embeddings": True} | tiny))
    _set_template(out, template)
    return out


def retemplated(model: Path, out: Path, template: str) -> Path:
    """A copy of the model folder `model` under another chat template: the same weights, as a
    second download of one model with a different template would be."""
    shutil.copytree(model, out)
    _set_template(out, template)
    return out


def _set_template(model: Path, template: str) -> None:
    """Only the template changes, as `save_pretrained` writes it."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model))
    tokenizer.chat_template = template
    tokenizer.save_pretrained(str(model))


def mla_server_spec(verifier: Path, log_file: Path):
    """How vLLM on CPU serves a tiny-dsv3 verifier: fp32, its language model alone, the CPU MLA
    attention backend (a drafter's variant: evaluation.online.server_specs)."""
    from eagle3_pipeline.serving.server import ServerSpec

    return ServerSpec(
        model=str(verifier),
        log_file=log_file,
        dtype="float32",
        language_model_only=True,
        extra_args=["--attention-backend", "CPU_MLA"],
    )
