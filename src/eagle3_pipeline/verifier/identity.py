"""What the verifier is: its (possibly nested) text config, shape, identity and code policy.

Kimi-K2.5 is multimodal and keeps its language model's config under `text_config` (or
`language_model`); everything here looks through that nesting so callers see one flat text config.

A stage reads the verifier once (`read_verifier`: config.json opened, hashed and its code policy
checked once) and hands the `VerifierFacts` down; the floors below take the facts, never params,
so nothing below a stage opens config.json, looks through its nesting or stamps its files again.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from eagle3_pipeline.config.params import VerifierParams
from eagle3_pipeline.core.errors import VerifierError

_NESTED_KEYS = ("text_config", "language_model", "llm_config")


def read_config(path: str | Path) -> dict[str, Any]:
    return json.loads(_config_bytes(path))


def _config_bytes(path: str | Path) -> bytes:
    cfg_file = Path(path) / "config.json"
    if not cfg_file.is_file():
        raise VerifierError(
            f"{cfg_file}: not found: run the 'verifier' stage (tiny profiles) or set verifier.path "
            "to a local model directory"
        )
    return cfg_file.read_bytes()


@dataclass(frozen=True)
class VerifierFacts:
    """The verifier as a run knows it: where it is, how it is named and loaded, and its
    config.json, read once. Its text model's shape and type look through multimodal wrappers."""

    path: str
    name: str | None
    revision: str | None
    trust_remote_code: bool
    config: dict[str, Any]  # config.json as written (a multimodal wrapper's whole)
    config_sha256: str

    @property
    def text(self) -> dict[str, Any]:
        return text_config(self.config)

    @property
    def num_layers(self) -> int:
        return shape(self.config)[0]

    @property
    def hidden_size(self) -> int:
        return shape(self.config)[1]

    @property
    def vocab_size(self) -> int:
        return shape(self.config)[2]

    @property
    def model_type(self) -> str | None:
        return self.text.get("model_type")

    @property
    def multimodal(self) -> bool:
        """A wrapper around the language model: vLLM builds it text-only."""
        return is_multimodal_wrapper(self.config)

    @property
    def custom_code(self) -> bool:
        return has_custom_code(self.config)

    @property
    def identity(self) -> dict[str, Any]:
        """How the verifier is named in manifests and drafter configs: never an absolute path."""
        return {
            "name_or_path": self.name or self.path,
            "revision": self.revision,
            "config_sha256": self.config_sha256,
        }

    @property
    def shape_record(self) -> dict[str, Any]:
        return shape_record(self.config)

    @property
    def declared_dtype(self) -> str | None:
        """The dtype config.json declares (the text model's, else the wrapper's), if any."""
        return self.text.get("dtype") or self.config.get("dtype") or self.config.get("torch_dtype")

    @cached_property
    def stamp(self) -> str:
        """`content_stamp` of the verifier's files, taken once per run (it reads each file's
        ends): what row keys name the verifier by, the same on every machine."""
        return content_stamp(self.path)


def read_verifier(v: VerifierParams) -> VerifierFacts:
    """The verifier of params' `verifier` section, config.json read and hashed once; a missing
    one is refused in one line (run the verifier stage, or point verifier.path at a model), and
    so is one with custom code that params do not trust (before any stage's hour of work)."""
    raw = _config_bytes(v.path)
    config = json.loads(raw)
    check_remote_code(config, v.trust_remote_code, f"{v.path}/config.json")
    return VerifierFacts(
        path=v.path,
        name=v.name,
        revision=v.revision,
        trust_remote_code=v.trust_remote_code,
        config=config,
        config_sha256=hashlib.sha256(raw).hexdigest(),
    )


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


def shape(config: dict[str, Any]) -> tuple[int, int, int]:
    """(num_hidden_layers, hidden_size, vocab_size) of the text model."""
    tc = text_config(config)
    return int(tc["num_hidden_layers"]), int(tc["hidden_size"]), int(tc["vocab_size"])


STAMP_ENDS_BYTES = 1 << 20  # bytes read at each end of a file larger than twice this


def content_stamp(path: str | Path) -> str:
    """Stamp of the verifier's files from their bytes, the same on every machine that holds
    them: each file's name, size, and the sha256 of its bytes (of its first and last MiB when
    larger than 2 MiB: config, tokenizer and chat template whole, weights by their ends).

    Rows are keyed on it (a teammate's pulled rows are reused only under the verifier that made
    them), where core/resume.files_stamp's mtimes differ between machines. Reads at most 2 MiB
    per file: a few hundred MB for Kimi-K2.5's shards. A change of weights that keeps every
    shard's size, first and last MiB (a few middle layers edited in place) is not seen: give
    such a verifier another verifier.revision.
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


def check_remote_code(config: dict[str, Any], trust_remote_code: bool, where: str) -> None:
    """vLLM and transformers refuse auto_map models without trust_remote_code, at hour one;
    `where`: the config.json as the user knows it."""
    if has_custom_code(config) and not trust_remote_code:
        raise VerifierError(
            f"{where} has auto_map (custom code) but verifier.trust_remote_code is false: set "
            "verifier.trust_remote_code: true if you trust this model's code"
        )
