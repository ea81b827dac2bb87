"""Can this verifier work at all here: what the installed vLLM and the verifier's own files
offer, checked before any work by `eagle3 plan` and by the `check` stage (both import this
module; it imports no other plan module but template.py, vllm_needs.py and vllm_classes.py,
since the check stage's DVC deps are its imports).

- vLLM knows the verifier's architecture: its model registry, or its Transformers backend.
- The class vLLM builds implements `SupportsEagle3`. vLLM captures aux hidden states only
  through it: the extract stage's vllm backend, online training, and serving an EAGLE-3,
  P-EAGLE or DFlash drafter beside the verifier all need it, and vLLM refuses a class without it
  only when it loads the model ("Model does not support EAGLE3 interface but
  aux_hidden_state_outputs was requested"), after generate ran in full.
- Each drafter vLLM is to serve has its class in vLLM's registry.
- The chat template renders a conversation with generate.chat_template_kwargs (template.py).
- Every path a stage reads is here (missing_paths): the prompt set, a pretrained verifier's
  config, weights and tokenizer, train.init_from's config and weights. Each is one line, worded
  once here for both, so plan and check give the same fix for the same path.

Each failure raises one line naming the class or file, what is missing and what to do
(vllm_needs.py words the ways out); what cannot be checked here (vLLM not installed and no
stage here starts it, a tiny verifier not built yet) is a note. vllm_classes.py keeps vLLM's
answers on disk.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3_pipeline.config.params import Params
from eagle3_pipeline.core import paths
from eagle3_pipeline.core.errors import (
    CheckpointError,
    DataError,
    ParamsError,
    PipelineError,
    VerifierError,
)
from eagle3_pipeline.evaluation import prompt_sets
from eagle3_pipeline.plan.template import TemplateSupport, check_chat_template, one_line
from eagle3_pipeline.plan.vllm_classes import VllmRegistry
from eagle3_pipeline.plan.vllm_needs import (
    DRAFTER_ARCHITECTURES,
    EAGLE3,
    Need,
    hf_capture,
    model_impl,
    served_drafters,
    transformers_backend_runs,
    unsupported,
    vllm_needs,
    without_vllm,
)
from eagle3_pipeline.verifier import identity as vf

# What vLLM's registry answered, kept against the files the answers come from (scratch: `eagle3
# clean-work` empties it). A rerun with the same vLLM then imports no vLLM (~10 s on 2 cores).
CACHE = paths.SCRATCH / "check" / "vllm_classes.json"
# The tiny profiles' verifiers, before the verifier stage builds them: (architectures, those of
# the nested text model) as verifier/tiny.py and tiny_kimi.py write config.json.
TINY_ARCHITECTURES: dict[str, tuple[list[str], list[str]]] = {
    "llama": (["LlamaForCausalLM"], []),
    "deepseek_v3": (["KimiK25ForConditionalGeneration"], ["DeepseekV3ForCausalLM"]),
}
BACKEND_CLASS = "TransformersForCausalLM"  # its MoE and multimodal variants share its base


@dataclass(frozen=True)
class VllmSupport:
    """What the installed vLLM offers this verifier (version None: not installed here)."""

    version: str | None
    architecture: str | None = None  # the config's architecture vLLM takes
    model_class: str | None = None  # the registry entry vLLM builds it with
    how: str = ""  # "model registry" or the Transformers backend
    eagle3: bool | None = None
    language_model: str | None = None  # a wrapper's nested text model, checked alike
    drafters: dict[str, bool] = field(default_factory=dict)  # architecture: registered
    notes: list[str] = field(default_factory=list)
    uses: list[str] = field(default_factory=list)  # the settings that need the interface

    def describe(self) -> str:
        """One line for the plan and the check stage's log."""
        if self.version is None:
            return "not installed here: " + "; ".join(self.notes)
        if self.model_class is None:
            return f"{self.version}: " + "; ".join(self.notes)
        inner = f", language model {self.language_model}" if self.language_model else ""
        built = "" if self.model_class == self.architecture else f" as {self.model_class}"
        has = "implements" if self.eagle3 else "does NOT implement"
        text = f"{self.version}: {self.architecture}{built} ({self.how}{inner}) {has} {EAGLE3}"
        if self.eagle3 and self.uses:
            text += f" ({', '.join(self.uses)} need it)"
        return "; ".join([text, *self.notes])

    def record(self) -> dict[str, Any]:
        """What was checked, never a setting: the bytes the check stage writes."""
        if self.version is None:
            return {"installed": False}
        return {
            "installed": True,
            "architecture": self.architecture,
            "model_class": self.model_class,
            "language_model": self.language_model,
            "supports_eagle3": self.eagle3,
            "drafter_architectures": self.drafters,
        }


@dataclass(frozen=True)
class VerifierSupport:
    vllm: VllmSupport
    template: TemplateSupport
    built_later: bool  # a tiny verifier the verifier stage builds from params

    def record(self) -> dict[str, Any]:
        return {
            "built_later": self.built_later,
            "vllm": self.vllm.record(),
            "chat_template": self.template.record(),
        }


def architectures(params: Params, config: dict[str, Any] | None) -> tuple[list[str], list[str]]:
    """(config.json's architectures, the nested text model's) as vLLM reads them; a tiny
    verifier not built yet (config None or without them): what the verifier stage writes."""
    top = list((config or {}).get("architectures") or [])
    inner_cfg = vf.text_config(config) if config else {}
    inner = list(inner_cfg.get("architectures") or []) if inner_cfg is not config else []
    if not top and params.verifier.source == "tiny":
        return TINY_ARCHITECTURES[params.verifier.tiny.architecture]
    return top, inner


def check_vllm(
    params: Params,
    config: dict[str, Any] | None,
    where: str,
    directory: Path | None = None,
    cache: Path | None = CACHE,
) -> VllmSupport:
    """The installed vLLM against the verifier's architecture and the drafters it serves."""
    needs = vllm_needs(params)
    here = [n for n in needs if n.here]
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        if here:
            raise ParamsError(
                f"vLLM is not installed here but {', '.join(n.key for n in here)} start it on "
                f"this machine: install it (make venv; the image has it), or set "
                f"{without_vllm(here)}"
            )
        why = "no stage here starts it" if needs else "no stage uses it"
        return VllmSupport(None, notes=[f"the verifier's class is not checked ({why})"])
    top, inner = architectures(params, config)
    if not top:
        raise VerifierError(
            f"{where}: no `architectures`: vLLM would guess the base model class from "
            "model_type: add the model's causal-LM class, e.g. "
            '"architectures": ["LlamaForCausalLM"]'
        )
    reg = VllmRegistry(Path(spec.origin).parent, cache)
    try:
        return _check_classes(params, reg, top, inner, config, where, directory, needs)
    finally:
        reg.save()


def _check_classes(
    params: Params,
    reg: VllmRegistry,
    top: list[str],
    inner: list[str],
    config: dict[str, Any] | None,
    where: str,
    directory: Path | None,
    needs: list[Need],
) -> VllmSupport:
    """vLLM's choice of class for `top` (as its registry resolves it), then its interface."""
    impl, notes, version = model_impl(params), [], reg.version
    custom = bool(config) and vf.has_custom_code(config or {})
    registered = [a for a in top if reg.known(a)]
    arch, model_class, how = top[0], None, "model registry"
    if impl == "transformers" and transformers_backend_runs(top[0]):
        model_class, how = BACKEND_CLASS, "Transformers backend, --model-impl transformers"
    elif impl != "transformers" and registered:
        arch = model_class = registered[0]
    elif impl == "auto" and (custom or transformers_backend_runs(arch)):
        model_class, how = BACKEND_CLASS, "Transformers backend"
        if custom:
            notes.append("whether the model's own code suits that backend is not checked")
    if model_class is None:
        fallback = (
            f"and transformers has no {arch} its Transformers backend can run"
            if impl != "vllm"
            else "and vllm.extra_args say --model-impl vllm"
        )
        if not needs:
            notes.append(f"vLLM does not know {arch} ({fallback}; no stage uses vLLM)")
            return VllmSupport(version, arch, None, "", None, notes=notes)
        without = (
            f", or do without vLLM: {without_vllm(needs)}"
            if hf_capture(params, directory) is None
            else ""
        )
        raise VerifierError(
            f"{where}: vLLM {version} does not know the architecture {arch} (not in its model "
            f"registry, {fallback}), which {', '.join(n.key for n in needs)} need: choose a "
            f"verifier vLLM {version} supports, or a vLLM that knows {arch}{without}"
        )
    try:
        cls, eagle3 = reg.implements(model_class)
    except PipelineError:
        raise
    except Exception as exc:
        raise VerifierError(
            f"{where}: vLLM {version}'s class for {arch} ({model_class}) does not import here "
            f"({one_line(exc)}): fix the vLLM install (make venv) or choose another verifier"
        ) from None
    if not eagle3 and any(n.eagle3 for n in needs):
        raise unsupported(params, where, version, arch, cls, needs, directory)
    if not eagle3:
        notes.append(f"vLLM cannot serve a drafter beside it (no stage here needs {EAGLE3})")
    language_model = None
    if eagle3 and inner and reg.known(inner[0]):  # the wrapper hands the capture to it
        language_model = inner[0]
        inner_cls, inner_eagle3 = reg.implements(language_model)
        if not inner_eagle3 and any(n.eagle3 for n in needs):
            raise unsupported(params, where, version, language_model, inner_cls, needs, directory)
    drafters = {a: reg.known(a) for a in dict.fromkeys(DRAFTER_ARCHITECTURES.values())}
    for key, drafter in served_drafters(params).items():
        if not drafters[drafter]:
            raise VerifierError(
                f"vLLM {version} has no {drafter} in its model registry, so it cannot serve "
                f"the drafter {key} asks for: use a vLLM that has it, or set "
                f"{next(n.instead for n in needs if n.key == key)}"
            )
    uses = [n.key for n in needs if n.eagle3]
    return VllmSupport(
        version, arch, model_class, how, eagle3, language_model, drafters, notes, uses
    )


def check_verifier(
    params: Params,
    config: dict[str, Any] | None,
    config_file: Path | None,
    where: str,
    required: bool = False,
    cache: Path | None = CACHE,
) -> VerifierSupport:
    """Both checks. config_file None: a tiny verifier the verifier stage builds from params."""
    directory = config_file.parent if config_file is not None else None
    vllm = check_vllm(params, config, where, directory, cache)
    template = check_chat_template(params, directory, required)
    return VerifierSupport(vllm, template, built_later=config_file is None)


# --- Paths a stage reads, all on this machine before the first stage --------------------------
# What vLLM and transformers load weights from; one of them is enough.
WEIGHT_GLOBS = ("*.safetensors", "*.bin")
TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json")
# What prepare reads (conversations/prompt_files.py SUFFIXES; not imported: the check stage's
# DVC deps are its imports, and a test holds the two equal).
PROMPT_SUFFIXES = (".jsonl", ".json", ".parquet")


def not_found(path: str | Path, field: str, params_path: str | Path, fix: str) -> str:
    """The one wording of a missing path, in `eagle3 plan` and the check stage alike."""
    return f"{path}: not found ({field} in {params_path}): {fix}"


def _prompts_missing(params: Params, where: str | Path) -> list[PipelineError]:
    """prepare reads prepare.prompts unless every prompt is synthesized (share 1.0)."""
    source = Path(params.prepare.prompts)
    if params.prepare.synthesized_share == 1.0 or source.exists():
        return []
    fix = f"set it to a prompt file ({', '.join(PROMPT_SUFFIXES)}) or a folder of them"
    return [DataError(not_found(source, "prepare.prompts", where, fix))]


def _model_fix(folder: Path, what: str, field: str) -> str:
    """How to get a model folder: the fetch command for a registry model, else a download."""
    if folder.parent == paths.REAL_MODELS:
        return f"run `eagle3 fetch-model {folder.name}`"
    return f"download {what} there, or set {field} to the folder that holds it"


def verifier_config_missing(params: Params, where: str | Path) -> VerifierError:
    """verifier.path has no config.json: the one line plan and check refuse it with."""
    folder = Path(params.verifier.path)
    fix = _model_fix(folder, "the model (config.json, weights, tokenizer files)", "verifier.path")
    return VerifierError(not_found(folder / "config.json", "verifier.path", where, fix))


def init_config_missing(params: Params, where: str | Path, name: str) -> CheckpointError:
    """train.init_from lacks `name` (config.json or its weights): the one line for it."""
    path = Path(params.train.init_from or "")
    folder = path.parent if path.suffix == ".json" and not path.is_dir() else path
    fix = _model_fix(folder, "the drafter", "train.init_from") + " (null: from scratch)"
    return CheckpointError(not_found(folder / name, "train.init_from", where, fix))


def _has_weights(folder: Path) -> bool:
    return any(any(folder.glob(g)) for g in WEIGHT_GLOBS)


def _verifier_missing(params: Params, where: str | Path) -> list[PipelineError]:
    """A pretrained verifier's config, weights and tokenizer (a tiny one is built by a stage)."""
    if params.verifier.source == "tiny":
        return []
    folder, field = Path(params.verifier.path), "verifier.path"
    if not (folder / "config.json").is_file():
        return [verifier_config_missing(params, where)]
    fix = _model_fix(folder, "the model (config.json, weights, tokenizer files)", field)
    out: list[PipelineError] = []
    if not _has_weights(folder):
        out.append(VerifierError(not_found(folder / WEIGHT_GLOBS[0], field, where, fix)))
    if not any((folder / f).is_file() for f in TOKENIZER_FILES):
        tok_fix = f"generate and tokenize load the tokenizer and its chat template from it: {fix}"
        out.append(VerifierError(not_found(folder / TOKENIZER_FILES[0], field, where, tok_fix)))
    return out


def _init_missing(params: Params, where: str | Path) -> list[PipelineError]:
    """train.init_from's config and weights: train loads both, after generate and extract."""
    if params.train.init_from is None:
        return []
    path = Path(params.train.init_from)
    folder = path.parent if path.suffix == ".json" and not path.is_dir() else path
    if not (folder / "config.json").is_file():
        return [init_config_missing(params, where, "config.json")]
    if not _has_weights(folder):
        return [init_config_missing(params, where, WEIGHT_GLOBS[0])]
    return []


def _prompt_sets_missing(params: Params) -> list[PipelineError]:
    """evaluate.public_sets that `eagle3 fetch-prompts` has not fetched: evaluate reads them."""
    if not params.evaluate.online:
        return []
    found = (prompt_sets.missing(name) for name in params.evaluate.public_sets)
    return [why for why in found if why is not None]


def missing_paths(params: Params, where: str | Path) -> list[PipelineError]:
    """Every path the run reads that is not here, in the order the stages meet them, each the
    one line both `eagle3 plan` and the check stage refuse it with: otherwise prepare, generate
    or train fails on it hours or days into the run."""
    return [
        *_prompts_missing(params, where),
        *_verifier_missing(params, where),
        *_init_missing(params, where),
        *_prompt_sets_missing(params),
    ]


def refuse_missing(params: Params, where: str | Path) -> None:
    """Raise the first missing path (missing_paths), if any."""
    missing = missing_paths(params, where)
    if missing:
        raise missing[0]
