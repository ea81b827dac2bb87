"""Builders the tests share: params, model folders as their readers see them, train settings.

A test states what differs from a shared start, never a whole literal of its own:

    make_params(verifier=pretrained(folder), prepare={"synthesize": {"count": 20}})
    make_params(TINY_LLAMA, generate={"chat_template_kwargs": {"thinking": "yes"}})
    fake_verifier(tmp_path / "v", LLAMA, tokenizer_config={})
    train_params(lr=1e-4, init_from=str(init))

Fixture configs (provenance in tests/fixtures/README.md): KIMI is moonshotai/Kimi-K2.5's
config.json, AQ_MEDAI the legacy flat EAGLE-3 config of AQ-MedAI/Kimi-K25-eagle3.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from eagle3_pipeline.config.params import Params
from eagle3_pipeline.config.training_params import TrainParams

if TYPE_CHECKING:
    from eagle3_pipeline.training.inputs import TrainJob

REPO = Path(__file__).resolve().parents[2]
PARAMS_YAML = REPO / "params.yaml"
TINY_LLAMA = REPO / "profiles/tiny-llama.yaml"
KIMI = REPO / "tests/fixtures/kimi-k2.5/config.json"
AQ_MEDAI = REPO / "tests/fixtures/aq-medai-kimi-k25-eagle3/config.json"

# A small Llama verifier's config.json (no weights): what plan and check read of it.
LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "num_hidden_layers": 8,
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 2048,
}
# The verifier the stand-in servers of generate's tests answer for: only its depth is read.
STAND_IN = {"num_hidden_layers": 8}

# Params: a base is a dict of sections or a params file (params.yaml, a profile).
Base = Mapping[str, Any] | Path | str | None


def merged(base: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """`base` with `overrides` deep-merged: a mapping into a mapping key by key, any other
    value (lists included) in place of the base's. Neither argument is changed."""
    out = copy.deepcopy(dict(base))
    for key, value in overrides.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merged(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _start(base: Base) -> dict[str, Any]:
    if base is None:
        return {}
    if isinstance(base, (Path, str)):
        return yaml.safe_load(Path(base).read_text()) or {}
    return copy.deepcopy(dict(base))


def raw_params(base: Base = None, **sections: Any) -> dict[str, Any]:
    """The params dict: `base` (sections, or a params file's) with `sections` deep-merged."""
    return merged(_start(base), sections)


def make_params(base: Base = None, **sections: Any) -> Params:
    """Params validated from `base` with `sections` deep-merged; the defaults for the rest.
    A file base is validated as load_params validates it (its path names it in errors)."""
    context = {"path": str(base)} if isinstance(base, (Path, str)) else None
    return Params.model_validate(raw_params(base, **sections), context=context)


def params_file(path: Path, base: Base = None, **sections: Any) -> Path:
    """`raw_params(base, **sections)` written to `path` as YAML, unvalidated (what a user's
    params.yaml says, for the stage or check that reads it)."""
    path.write_text(yaml.safe_dump(raw_params(base, **sections), sort_keys=False))
    return path


def pretrained(path: Path | str, **verifier: Any) -> dict[str, Any]:
    """The `verifier` section of a pretrained verifier in `path`."""
    return {"source": "pretrained", "path": str(path), **verifier}


# Model folders: the one place tests write a config.json (or another model file) by hand.
FileContent = Mapping[str, Any] | str | bytes | Path


def model_files(folder: Path, **files: FileContent) -> Path:
    """`folder` (made if missing) with each of `files` written in it: a name without a dot
    is a .json file (`config` -> config.json, `tokenizer_config` -> tokenizer_config.json);
    a mapping is written as json.dumps writes it, text or bytes as given, a Path's text as
    the file holds it (a fixture, byte for byte). Other files in the folder stay."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        target = folder / (name if "." in name else f"{name}.json")
        if isinstance(content, Mapping):
            target.write_text(json.dumps(content))
        elif isinstance(content, bytes):
            target.write_bytes(content)
        elif isinstance(content, Path):
            target.write_text(content.read_text())
        else:
            target.write_text(content)
    return folder


def fake_verifier(
    folder: Path, config: FileContent | None = None, **extra_files: FileContent
) -> Path:
    """A verifier folder as far as its readers look without a model: config.json (`config`;
    None: LLAMA) and `extra_files` (model_files' names: tokenizer_config={} and the like,
    **{"model.safetensors": b""} for weights that are present but never loaded)."""
    return model_files(folder, config=LLAMA if config is None else config, **extra_files)


def stand_in_verifier(root: Path) -> Path:
    """root/verifier, as the stand-in vLLM servers' tests name it: STAND_IN's config alone."""
    return fake_verifier(root / "verifier", STAND_IN)


# One epoch, no noise, no warmup, one seed, no worker processes, every checkpoint kept: the
# settings the tests that call the trainer directly share (each names what it changes).
QUIET_TRAIN: dict[str, Any] = {
    "epochs": 1,
    "lr": 3e-3,
    "scheduler": "none",
    "warmup_ratio": 0.0,
    "noise_std": 0.0,
    "ttt_steps": 3,
    "ttt_step_loss_decay": 1.0,
    "max_tokens_per_batch": 256,
    "seed": 0,
    "num_workers": 0,
    "train_lm_head": False,
    "keep_last": None,
}


def train_params(**overrides: Any) -> TrainParams:
    """TrainParams of QUIET_TRAIN with `overrides` (TrainParams fields), validated."""
    return TrainParams(**(QUIET_TRAIN | overrides))


def train_job(
    train: TrainParams | None = None,
    cluster: Mapping[str, Any] | None = None,
    aux: list[int] | None = None,
    row_ids: list[str] | None = None,
) -> TrainJob:
    """A resolved training run (training/inputs.TrainJob) without a store: `train` (QUIET_TRAIN's
    when None) on cluster section `cluster`, aux ids `aux` ([1, 2]) + final 3, rows `row_ids`
    (["a", "b"]), scratch folder data/.work/train/k."""
    from eagle3_pipeline.config.params import VllmParams
    from eagle3_pipeline.config.training_params import ClusterParams
    from eagle3_pipeline.drafter.conventions import RunConventions
    from eagle3_pipeline.training.inputs import TrainInputs, TrainJob
    from eagle3_pipeline.training.run import TrainSettings
    from eagle3_pipeline.verifier.identity import VerifierFacts

    conventions = RunConventions([1, 2] if aux is None else aux, 3, {}, {}, {})
    verifier = VerifierFacts("models/verifier", None, None, False, {}, "")
    work = Path("data/.work/train/k")
    inputs = TrainInputs(
        conventions, [], 0, work, ["a", "b"] if row_ids is None else row_ids, verifier
    )
    settings = TrainSettings.from_params(
        train or train_params(),
        data_dir=inputs.data_dir,
        save_dir=inputs.save_dir,
        verifier_dir=Path(verifier.path),
        vocab_dir=Path("data/vocab"),
        draft_vocab_size=64,
        conventions=conventions,
        train_data_ratio=1.0,
        nodes=1,
    )
    return TrainJob(settings, inputs, ClusterParams.model_validate(cluster or {}), VllmParams())
