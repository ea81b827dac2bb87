"""The config files a plan is made from: the verifier's config.json and tokenizer files, and the
init drafter's config.json. Never weights: the plan must run before any download finishes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3_pipeline.config.params import Params
from eagle3_pipeline.core import readers
from eagle3_pipeline.core.errors import VerifierError
from eagle3_pipeline.drafter.conventions import read_init_config
from eagle3_pipeline.verifier import identity as vf


@dataclass(frozen=True)
class VerifierShape:
    """The verifier's text model as far as the drafter is concerned."""

    source: str
    model_type: str
    nested: bool
    num_layers: int
    hidden_size: int
    vocab_size: int
    remote_code: bool


DAMAGED_TOKENIZER = "the verifier's tokenizer files are damaged"


def _config_file(path: str | Path) -> Path:
    """A config.json itself, or the model directory holding it (existing or not)."""
    path = Path(path)
    return path if path.suffix == ".json" and not path.is_dir() else path / "config.json"


def tiny_verifier_config(params: Params) -> dict[str, Any]:
    """The config the verifier stage will write for a tiny profile, so plan works before it runs."""
    t = params.verifier.tiny
    return {
        "model_type": t.architecture,
        "num_hidden_layers": t.num_hidden_layers,
        "hidden_size": t.hidden_size,
        "intermediate_size": t.intermediate_size,
        "num_attention_heads": t.num_attention_heads,
        "num_key_value_heads": t.num_key_value_heads,
        "vocab_size": t.vocab_size,
    }


def load_verifier_config(params: Params, override: str | Path | None) -> tuple[dict, Path | None]:
    """(config, its file); a tiny verifier not built yet is described from params."""
    if override is not None:
        path = _config_file(override)
    else:
        path = Path(params.verifier.path) / "config.json"
        if params.verifier.source == "tiny" and not path.is_file():
            return tiny_verifier_config(params), None
    fix = "set verifier.path to the model directory or pass --verifier-config PATH"
    config = readers.read_json_object(path, VerifierError, fix)
    if override is None and params.verifier.source == "tiny":
        tiny, built = params.verifier.tiny, vf.text_config(config)
        if (built.get("num_hidden_layers"), built.get("hidden_size")) != (
            tiny.num_hidden_layers,
            tiny.hidden_size,
        ):  # built from older params: the verifier stage will rebuild it from these
            return tiny_verifier_config(params), None
    return config, path


def verifier_shape(config: dict[str, Any], source: str) -> VerifierShape:
    """The text model's sizes, looking through multimodal `text_config` nesting."""
    tc = vf.text_config(config)
    for key in ("num_hidden_layers", "hidden_size", "vocab_size"):
        if not isinstance(tc.get(key), int):
            raise VerifierError(f"{source}: text config has no integer {key}: is it a causal LM?")
    return VerifierShape(
        source=source,
        model_type=str(tc.get("model_type", "?")),
        nested=tc is not config,
        num_layers=tc["num_hidden_layers"],
        hidden_size=tc["hidden_size"],
        vocab_size=tc["vocab_size"],
        remote_code=vf.has_custom_code(config),
    )


def tokenizer_tokens(directory: Path) -> tuple[str, set[str]] | None:
    """(files read, token strings) from tokenizer.json / tokenizer_config.json, if present."""
    tokens: set[str] = set()
    read: list[str] = []
    tok_json = directory / "tokenizer.json"
    if tok_json.is_file():
        data = readers.read_json_object(tok_json, VerifierError, DAMAGED_TOKENIZER)
        tokens |= {t.get("content", "") for t in data.get("added_tokens") or []}
        vocab = (data.get("model") or {}).get("vocab")
        if isinstance(vocab, dict):
            tokens |= set(vocab)
        read.append(tok_json.name)
    tok_cfg = directory / "tokenizer_config.json"
    if tok_cfg.is_file():
        data = readers.read_json_object(tok_cfg, VerifierError, DAMAGED_TOKENIZER)
        decoder = data.get("added_tokens_decoder") or {}
        tokens |= {t.get("content", "") for t in decoder.values() if isinstance(t, dict)}
        read.append(tok_cfg.name)
    return (", ".join(read), tokens) if read else None


def load_init_config(params: Params, override: str | Path | None) -> tuple[dict, Path] | None:
    """(config, its file) of the init drafter, or None when the run starts from scratch."""
    if override is None and params.train.init_from is None:
        return None
    return read_init_config(override if override is not None else params.train.init_from)
