"""The config files a plan is made from: the verifier's config.json and tokenizer files, and the
init drafter's config.json. Never weights: the plan must run before any download finishes, so
a model folder a profile names but this machine lacks is read from the copy of its config.json
the project ships (profiles/configs/<folder name>/), said so in one line.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3_pipeline.config.params import Params
from eagle3_pipeline.core import readers
from eagle3_pipeline.core.errors import VerifierError
from eagle3_pipeline.drafter.conventions import read_init_config
from eagle3_pipeline.plan import support
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
# Config files the project ships (no weights) for the model folders its profiles name.
SHIPPED_CONFIGS = Path("profiles/configs")


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


def shipped_config(folder: str | Path) -> Path | None:
    """The config.json the project ships for a model folder a profile names (SHIPPED_CONFIGS/
    <folder name>/), so the profile plans before its weights are downloaded; None if none."""
    shipped = SHIPPED_CONFIGS / Path(folder).name / "config.json"
    return shipped if shipped.is_file() else None


def from_files(params: Params, verifier_config: object, init_config: object) -> bool:
    """A plan made from config files, not from this machine's model folders: given ones
    (--verifier-config, --init-config) or shipped ones standing in for absent folders."""
    init = params.train.init_from
    return (
        verifier_config is not None
        or init_config is not None
        or (params.verifier.source != "tiny" and _shipped_for(params.verifier.path) is not None)
        or (init is not None and _shipped_for(init) is not None)
    )


def _shipped_for(folder: str | Path) -> Path | None:
    """The shipped config standing in for `folder`: only when the folder has none."""
    return None if _config_file(folder).is_file() else shipped_config(folder)


def shipped_note(what: str, shipped: Path, folder: str | Path) -> str:
    """The one line a plan from a shipped config says."""
    return f"{what} config: {shipped} (weights not at {folder}; planned from the shipped config)"


def load_verifier_config(
    params: Params, override: str | Path | None, where: str | Path = "params.yaml"
) -> tuple[dict, Path | None, str | None]:
    """(config, its file, a note when it is the shipped copy); a tiny verifier not built yet is
    described from params. `where`: the params file, named when verifier.path is not there."""
    note = None
    if override is not None:
        path = _config_file(override)
    else:
        path = Path(params.verifier.path) / "config.json"
        if params.verifier.source == "tiny" and not path.is_file():
            return tiny_verifier_config(params), None, None
        shipped = _shipped_for(params.verifier.path)
        if shipped is not None:
            path, note = shipped, shipped_note("verifier", shipped, params.verifier.path)
        elif not path.is_file():
            raise support.verifier_config_missing(params, where)
    fix = "set verifier.path to the model directory or pass --verifier-config PATH"
    config = readers.read_json_object(path, VerifierError, fix)
    if override is None and note is None and params.verifier.source == "tiny":
        tiny, built = params.verifier.tiny, vf.text_config(config)
        if (built.get("num_hidden_layers"), built.get("hidden_size")) != (
            tiny.num_hidden_layers,
            tiny.hidden_size,
        ):  # built from older params: the verifier stage will rebuild it from these
            return tiny_verifier_config(params), None, None
    return config, path, note


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


def load_init_config(
    params: Params, override: str | Path | None, where: str | Path = "params.yaml"
) -> tuple[tuple[dict, Path] | None, str | None]:
    """((config, its file) of the init drafter, or None when the run starts from scratch; a
    note when the config is the shipped copy)."""
    if override is None and params.train.init_from is None:
        return None, None
    if override is not None:
        return read_init_config(override), None
    folder = Path(params.train.init_from)
    shipped = _shipped_for(folder)
    if shipped is None and not _config_file(folder).is_file():
        raise support.init_config_missing(params, where, "config.json")
    if shipped is None:
        return read_init_config(folder), None
    return read_init_config(shipped), shipped_note("init", shipped, folder)
