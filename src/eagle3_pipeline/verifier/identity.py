"""What the verifier is: its (possibly nested) text config, shape, identity and code policy.

Kimi-K2.5 is multimodal and keeps its language model's config under `text_config` (or
`language_model`); everything here looks through that nesting so callers see one flat text config.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from eagle3_pipeline.config.params import Params
from eagle3_pipeline.core.errors import VerifierError

_NESTED_KEYS = ("text_config", "language_model", "llm_config")


def read_config(path: str | Path) -> dict[str, Any]:
    cfg_file = Path(path) / "config.json"
    if not cfg_file.is_file():
        raise VerifierError(
            f"{cfg_file}: not found: run the 'verifier' stage (tiny profiles) or set verifier.path "
            "to a local model directory"
        )
    return json.loads(cfg_file.read_text())


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's config, looking through multimodal wrappers."""
    for key in _NESTED_KEYS:
        inner = config.get(key)
        if isinstance(inner, dict) and "num_hidden_layers" in inner:
            return text_config(inner)
    if "num_hidden_layers" not in config:
        raise VerifierError(
            "verifier config.json has no num_hidden_layers (nor a nested text_config with one): "
            "is verifier.path a causal language model?"
        )
    return config


def is_multimodal_wrapper(config: dict[str, Any]) -> bool:
    """The language model sits under a wrapper's key (Kimi-K2.5): transformers loads it as an
    image-text-to-text model, and vLLM should build it text-only (--language-model-only)."""
    return text_config(config) is not config


def language_model_only(path: str | Path) -> bool:
    """Whether vLLM should serve the verifier at `path` text-only (a multimodal wrapper).

    False when there is no local config.json to read (a hub id vLLM resolves itself)."""
    if not (Path(path) / "config.json").is_file():
        return False
    return is_multimodal_wrapper(read_config(path))


def shape(config: dict[str, Any]) -> tuple[int, int, int]:
    """(num_hidden_layers, hidden_size, vocab_size) of the text model."""
    tc = text_config(config)
    return int(tc["num_hidden_layers"]), int(tc["hidden_size"]), int(tc["vocab_size"])


def config_sha256(path: str | Path) -> str:
    return hashlib.sha256((Path(path) / "config.json").read_bytes()).hexdigest()


def files_stamp(path: str | Path) -> str:
    """Cheap stamp of the verifier's files (name, size, mtime): changes when the weights change.

    Resumable stages key their scratch work on it, so rows made by an earlier verifier (same
    config.json, other weights) are never reused. Never hashes contents: 547 GB for Kimi-K2.5.
    """
    parts = sorted(
        (f.name, f.stat().st_size, f.stat().st_mtime_ns)
        for f in Path(path).iterdir()
        if f.is_file()
    )
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()


STAMP_ENDS_BYTES = 1 << 20  # bytes read at each end of a file larger than twice this


def content_stamp(path: str | Path) -> str:
    """Stamp of the verifier's files from their bytes, the same on every machine that holds
    them: each file's name, size, and the sha256 of its bytes (of its first and last MiB when
    larger than 2 MiB: config, tokenizer and chat template whole, weights by their ends).

    Rows are keyed on it (a teammate's pulled rows are reused only under the verifier that made
    them), where files_stamp's mtimes differ between machines. Reads at most 2 MiB per file:
    a few hundred MB for Kimi-K2.5's shards. A change of weights that keeps every shard's size,
    first and last MiB (a few middle layers edited in place) is not seen: give such a verifier
    another verifier.revision.
    """
    parts = []
    for f in sorted(p for p in Path(path).iterdir() if p.is_file()):
        size = f.stat().st_size
        h = hashlib.sha256()
        with open(f, "rb") as fh:
            if size <= 2 * STAMP_ENDS_BYTES:
                h.update(fh.read())
            else:
                h.update(fh.read(STAMP_ENDS_BYTES))
                fh.seek(size - STAMP_ENDS_BYTES)
                h.update(fh.read(STAMP_ENDS_BYTES))
        parts.append((f.name, size, h.hexdigest()))
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()


def identity(params: Params) -> dict[str, Any]:
    """How the verifier is named in manifests and drafter configs: never an absolute path."""
    v = params.verifier
    return {
        "name_or_path": v.name or v.path,
        "revision": v.revision,
        "config_sha256": config_sha256(v.path),
    }


def shape_record(config: dict[str, Any]) -> dict[str, Any]:
    """The text model's type and sizes: what names a verifier where its config.json's bytes
    cannot be compared (a plan from a copy of the config, not the verifier's own file)."""
    tc = text_config(config)
    return {
        "model_type": tc.get("model_type"),
        "num_hidden_layers": tc.get("num_hidden_layers"),
        "hidden_size": tc.get("hidden_size"),
        "vocab_size": tc.get("vocab_size"),
    }


def needs_remote_code(config: dict[str, Any]) -> bool:
    """This config (not its nested text config) names classes of the model's own code."""
    return bool(config.get("auto_map"))


def has_custom_code(config: dict[str, Any]) -> bool:
    """auto_map in config.json or in its text config: loading it runs the model's own code."""
    return needs_remote_code(config) or needs_remote_code(text_config(config))


def check_remote_code(params: Params, config: dict[str, Any], where: str | None = None) -> None:
    """vLLM and transformers refuse auto_map models without trust_remote_code, at hour one."""
    if has_custom_code(config) and not params.verifier.trust_remote_code:
        raise VerifierError(
            f"{where or f'{params.verifier.path}/config.json'} has auto_map (custom code) but "
            "verifier.trust_remote_code is false: set verifier.trust_remote_code: true if you "
            "trust this model's code"
        )
