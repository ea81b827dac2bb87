"""Loading the verifier: tokenizer, transformers model, and its decoder layers.

Weights are always read from `verifier.path`; `trust_remote_code` only when params say so.
"""

from __future__ import annotations

from eagle3_pipeline.config.params import VerifierParams
from eagle3_pipeline.core.errors import VerifierError
from eagle3_pipeline.verifier.identity import VerifierFacts, needs_remote_code


def load_tokenizer(v: VerifierParams | VerifierFacts):  # -> PreTrainedTokenizerBase
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(
        v.path, revision=v.revision, trust_remote_code=v.trust_remote_code
    )


def load_model(verifier: VerifierFacts, dtype: str = "auto"):  # -> PreTrainedModel
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    # A wrapper without remote code (transformers' own Kimi_K25) is no *ForCausalLM; its
    # image-text-to-text class takes text alone and has generate() and lm_head all the same.
    native_wrapper = verifier.multimodal and not needs_remote_code(verifier.config)
    auto = AutoModelForImageTextToText if native_wrapper else AutoModelForCausalLM
    model = auto.from_pretrained(
        verifier.path,
        revision=verifier.revision,
        trust_remote_code=verifier.trust_remote_code,
        dtype=dtype if dtype == "auto" else getattr(torch, dtype),
    )
    model.eval()
    return model


def decoder_layers(model) -> list:  # list[torch.nn.Module]
    """The decoder layer list of a causal LM, wherever the wrapper keeps it."""
    for path in ("model.layers", "model.language_model.layers", "language_model.model.layers"):
        obj = model
        for attr in path.split("."):
            obj = getattr(obj, attr, None)
            if obj is None:
                break
        if obj is not None:
            return list(obj)
    raise VerifierError(f"cannot find decoder layers in {type(model).__name__}")
