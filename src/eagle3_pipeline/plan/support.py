"""Can this verifier work at all here: what the installed vLLM and the verifier's own files
offer, checked before any work by `eagle3 plan` and by the `check` stage (both import this
module; it imports no other plan module but template.py, since the check stage's DVC deps are
its imports).

- vLLM knows the verifier's architecture: its model registry, or its Transformers backend.
- The class vLLM builds implements `SupportsEagle3`. vLLM captures aux hidden states only
  through it: the extract stage's vllm backend, online training, and serving an EAGLE-3,
  P-EAGLE or DFlash drafter beside the verifier all need it, and vLLM refuses a class without it
  only when it loads the model ("Model does not support EAGLE3 interface but
  aux_hidden_state_outputs was requested"), after generate ran in full.
- Each drafter vLLM is to serve has its class in vLLM's registry.
- The chat template renders a conversation with generate.chat_template_kwargs (template.py).

Each failure raises one line naming the class or file, what is missing and what to do; what
cannot be checked here (vLLM not installed and no stage here starts it, a tiny verifier not
built yet) is a note.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import importlib.util
import inspect
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3_pipeline import atomic, paths
from eagle3_pipeline.errors import ParamsError, PipelineError, ServerError, VerifierError
from eagle3_pipeline.params import Params
from eagle3_pipeline.plan.template import TemplateSupport, check_chat_template, one_line
from eagle3_pipeline.verifier import identity as vf
from eagle3_pipeline.verifier import loading

EAGLE3 = "SupportsEagle3"
# What vLLM's registry answered, kept against the files the answers come from (scratch: `eagle3
# clean-work` empties it). A rerun with the same vLLM then imports no vLLM (~10 s on 2 cores).
CACHE = paths.SCRATCH / "check" / "vllm_classes.json"
# The architecture vLLM serves each drafter family as (speculators format; export.format flat:
# the legacy name), as vLLM 0.32's speculators config reader names them.
DRAFTER_ARCHITECTURES: dict[str, str] = {
    "eagle3": "Eagle3LlamaForCausalLM",
    "eagle3 (flat)": "LlamaForCausalLMEagle3",
    "peagle": "PeagleLlamaForCausalLM",
    "dflash": "DFlashDraftModel",
}
# The tiny profiles' verifiers, before the verifier stage builds them: (architectures, those of
# the nested text model) as verifier/tiny.py and tiny_kimi.py write config.json.
TINY_ARCHITECTURES: dict[str, tuple[list[str], list[str]]] = {
    "llama": (["LlamaForCausalLM"], []),
    "deepseek_v3": (["KimiK25ForConditionalGeneration"], ["DeepseekV3ForCausalLM"]),
}
BACKEND_CLASS = "TransformersForCausalLM"  # its MoE and multimodal variants share its base


@dataclass(frozen=True)
class Need:
    """A setting that uses vLLM, what avoids it, and what it asks of the verifier's class."""

    key: str  # as params.yaml says it, e.g. "extract.backend: vllm"
    instead: str  # the setting that does without vLLM
    eagle3: bool  # it captures aux hidden states or serves a drafter beside the verifier
    here: bool  # it starts vLLM on this machine (not on cluster nodes or a given server)


def vllm_needs(params: Params) -> list[Need]:
    """The settings of this run that use vLLM, in pipeline order."""
    g, local = params.generate, params.cluster.engine == "local"
    out: list[Need] = []
    s = params.prepare.synthesize
    if s.count and s.backend == "vllm":
        out.append(
            Need("prepare.synthesize.backend: vllm", "prepare.synthesize.backend: hf", False, True)
        )
    if g.backend == "vllm" and not g.given_servers:
        out.append(Need("generate.backend: vllm", "generate.backend: hf", False, local))
    if params.extract.backend == "vllm":
        out.append(Need("extract.backend: vllm", "extract.backend: hf", True, local))
    if params.train.hidden_states == "online":
        endpoint = params.train.online.endpoint
        out.append(
            Need("train.hidden_states: online", "train.hidden_states: store", True, not endpoint)
        )
    if params.evaluate.online:
        out.append(Need("evaluate.online: true", "evaluate.online: false", True, True))
    out += [
        Need(f"families.{name}", f"remove families.{name}", True, True) for name in params.families
    ]
    return out


def served_drafters(params: Params) -> dict[str, str]:
    """{setting that serves it: drafter architecture} for every drafter vLLM serves here."""
    out: dict[str, str] = {}
    if params.evaluate.online:
        flat = params.export.format == "flat"
        out["evaluate.online: true"] = DRAFTER_ARCHITECTURES["eagle3 (flat)" if flat else "eagle3"]
    for name, family in params.families.items():
        out[f"families.{name}"] = DRAFTER_ARCHITECTURES[family.speculator_type]
    return out


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


def _model_impl(params: Params) -> str:
    """vLLM's --model-impl among vllm.extra_args (`auto` unless given)."""
    args = params.vllm.extra_args
    for i, arg in enumerate(args):
        if arg == "--model-impl" and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith("--model-impl="):
            return arg.split("=", 1)[1]
    return "auto"


def _import_vllm() -> tuple[str, Any, Any]:
    """(version, ModelRegistry, supports_eagle3) of the installed vLLM."""
    import vllm

    try:
        from vllm import ModelRegistry  # the public entry point
    except ImportError:
        from vllm.model_executor.models.registry import ModelRegistry
    try:
        from vllm.model_executor.models.interfaces import supports_eagle3
    except ImportError:  # the interface's own flag, which SupportsEagle3 sets

        def supports_eagle3(cls: type) -> bool:
            return bool(getattr(cls, "supports_eagle3", False))

    try:  # out-of-tree models register themselves here, as every engine start does
        from vllm.plugins import load_general_plugins

        load_general_plugins()
    except Exception:
        pass
    return str(getattr(vllm, "__version__", "?")), ModelRegistry, supports_eagle3


def _load_class(registry: Any, arch: str) -> type:
    """The class of one registry entry, importing its one module (no engine, no subprocess):
    the entry's own loader (vLLM 0.32's lazy entries), else its module and class names, else
    the registry's loader."""
    entry = getattr(registry, "models", {}).get(arch)
    if entry is not None and hasattr(entry, "load_model_cls"):
        return entry.load_model_cls()
    if entry is not None and hasattr(entry, "module_name"):
        return getattr(importlib.import_module(entry.module_name), entry.class_name)
    cls = registry._try_load_model_cls(arch)
    if cls is None:
        raise ImportError(f"vLLM's registry could not load {arch}")
    return cls


def _stamp(files: list[str]) -> list[list[Any]]:
    """[path, size, mtime_ns] of each file; a missing file stamps as [path, -1, -1]."""
    out: list[list[Any]] = []
    for f in files:
        try:
            st = os.stat(f)
            out.append([f, st.st_size, st.st_mtime_ns])
        except OSError:
            out.append([f, -1, -1])
    return out


def _installed_stamp(vllm_dir: Path) -> dict[str, Any]:
    """What every cached answer depends on: vLLM's version, registry and interfaces files, and
    the plugins that may register models."""
    names = ["__init__.py", "version.py", "_version.py"]
    names += [f"model_executor/models/{n}" for n in ("registry.py", "interfaces.py")]
    try:
        plugins = sorted(
            e.value for e in importlib.metadata.entry_points(group="vllm.general_plugins")
        )
    except Exception:
        plugins = []
    return {
        "files": _stamp([str(vllm_dir / n) for n in names]),
        "plugins": plugins,
        "VLLM_PLUGINS": os.environ.get("VLLM_PLUGINS"),
    }


class _Registry:
    """vLLM's model registry as far as the checks ask it, imported only when an answer is not
    cached yet (or a file it came from changed)."""

    def __init__(self, vllm_dir: Path, cache: Path | None) -> None:
        self.cache, self.changed = cache, False
        self._live: tuple[str, Any, Any] | None = None
        stamp = _installed_stamp(vllm_dir)
        data: dict[str, Any] = {}
        if cache is not None and cache.is_file():
            try:
                data = json.loads(cache.read_text())
            except ValueError:
                data = {}
        if not isinstance(data, dict) or data.get("installed") != stamp:
            data = {"installed": stamp, "known": {}, "classes": {}}
        self.data = data

    def _vllm(self) -> tuple[str, Any, Any]:
        if self._live is None:
            try:
                self._live = _import_vllm()
            except Exception as exc:
                raise ServerError(
                    f"vLLM is installed but does not import ({one_line(exc)}): reinstall it "
                    "(make venv)"
                ) from None
            self.changed |= self.data.get("version") != self._live[0]
            self.data["version"] = self._live[0]
        return self._live

    @property
    def version(self) -> str:
        return self.data.get("version") or self._vllm()[0]

    def known(self, arch: str) -> bool:
        if arch not in self.data["known"]:
            self.data["known"][arch] = arch in set(self._vllm()[1].get_supported_archs())
            self.changed = True
        return self.data["known"][arch]

    def implements(self, key: str) -> tuple[str, bool]:
        """(class name, implements SupportsEagle3) of a registry entry, loading its class."""
        entry = self.data["classes"].get(key)
        if entry is None or _stamp([f for f, *_ in entry["files"]]) != entry["files"]:
            _, registry, supports_eagle3 = self._vllm()
            cls = _load_class(registry, key)
            files = {inspect.getsourcefile(c) for c in cls.__mro__ if c.__module__[:5] == "vllm."}
            entry = {
                "name": cls.__name__,
                "eagle3": bool(supports_eagle3(cls)),
                "files": _stamp(sorted(f for f in files if f)),
            }
            self.data["classes"][key] = entry
            self.changed = True
        return entry["name"], entry["eagle3"]

    def save(self) -> None:
        if self.changed and self.cache is not None:
            with contextlib.suppress(OSError):  # read-only: the next run imports vLLM again
                atomic.write_json(self.cache, self.data)


def _transformers_backend_runs(arch: str) -> bool:
    """vLLM's rule for running a transformers class through its Transformers backend."""
    try:
        import transformers

        cls = getattr(transformers, arch, None)
        return cls is not None and bool(
            cls.is_backend_compatible() or cls._can_set_attn_implementation()
        )
    except Exception:  # an older transformers without these methods: vLLM cannot either
        return False


def _hf_capture(params: Params, directory: Path | None) -> str | None:
    """Why the hf extract backend (transformers with hooks on the decoder layers, as
    verifier/loading.py finds them) cannot capture this verifier; None when it can. Builds the
    model on the meta device: no weights are read."""
    if directory is None:
        return "not checked (no config folder)"
    try:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

        trust = params.verifier.trust_remote_code
        config = vf.read_config(directory)
        native_wrapper = vf.is_multimodal_wrapper(config) and not vf.needs_remote_code(config)
        auto = AutoModelForImageTextToText if native_wrapper else AutoModelForCausalLM
        hf_config = AutoConfig.from_pretrained(directory, trust_remote_code=trust)
        with torch.device("meta"):
            model = auto.from_config(hf_config, trust_remote_code=trust)
    except Exception as exc:  # transformers cannot build it: neither can the hf backends
        return f"transformers cannot build it ({type(exc).__name__})"
    try:
        loading.decoder_layers(model)
    except VerifierError:
        return f"transformers' {type(model).__name__} keeps no decoder layers where it looks"
    return None


def _without_vllm(needs: list[Need]) -> str:
    return ", ".join(n.instead for n in needs)


def _unsupported(
    params: Params,
    where: str,
    version: str,
    arch: str,
    cls: str,
    needs: list[Need],
    directory: Path | None,
) -> VerifierError:
    """One line: the class, what vLLM lacks, who needs it, and every way out that is true."""
    users = [n for n in needs if n.eagle3]
    ways = [
        "choose a verifier whose vLLM class implements it (LlamaForCausalLM, Qwen2ForCausalLM, "
        "Qwen3ForCausalLM, DeepseekV3ForCausalLM, KimiK25ForConditionalGeneration, ...)"
    ]
    if _model_impl(params) != "transformers" and _transformers_backend_runs(arch):
        ways.append(
            "let vLLM's Transformers backend run it (it implements the interface): add "
            '"--model-impl", "transformers" to vllm.extra_args'
        )
    capture_needed = any(n.key.startswith(("extract.", "train.")) for n in users)
    why_not = _hf_capture(params, directory) if capture_needed else None
    if why_not is None:
        ways.append(
            f"or train a drafter this vLLM cannot serve, measured offline only: "
            f"{_without_vllm(users)}"
        )
    hf = f"; the hf extract backend cannot capture it either: {why_not}" if why_not else ""
    return VerifierError(
        f"{where}: vLLM {version}'s {cls} does not implement {EAGLE3}, so vLLM can neither "
        f"capture its aux hidden states nor serve a drafter beside it, which "
        f"{', '.join(n.key for n in users)} need (vLLM refuses only when it loads the model, "
        f"after generate ran in full): {'; '.join(ways)}{hf}"
    )


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
                f"{_without_vllm(here)}"
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
    reg = _Registry(Path(spec.origin).parent, cache)
    try:
        return _check_classes(params, reg, top, inner, config, where, directory, needs)
    finally:
        reg.save()


def _check_classes(
    params: Params,
    reg: _Registry,
    top: list[str],
    inner: list[str],
    config: dict[str, Any] | None,
    where: str,
    directory: Path | None,
    needs: list[Need],
) -> VllmSupport:
    """vLLM's choice of class for `top` (as its registry resolves it), then its interface."""
    impl, notes, version = _model_impl(params), [], reg.version
    custom = bool(config) and vf.has_custom_code(config or {})
    registered = [a for a in top if reg.known(a)]
    arch, model_class, how = top[0], None, "model registry"
    if impl == "transformers" and _transformers_backend_runs(top[0]):
        model_class, how = BACKEND_CLASS, "Transformers backend, --model-impl transformers"
    elif impl != "transformers" and registered:
        arch = model_class = registered[0]
    elif impl == "auto" and (custom or _transformers_backend_runs(arch)):
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
            f", or do without vLLM: {_without_vllm(needs)}"
            if _hf_capture(params, directory) is None
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
        raise _unsupported(params, where, version, arch, cls, needs, directory)
    if not eagle3:
        notes.append(f"vLLM cannot serve a drafter beside it (no stage here needs {EAGLE3})")
    language_model = None
    if eagle3 and inner and reg.known(inner[0]):  # the wrapper hands the capture to it
        language_model = inner[0]
        inner_cls, inner_eagle3 = reg.implements(language_model)
        if not inner_eagle3 and any(n.eagle3 for n in needs):
            raise _unsupported(params, where, version, language_model, inner_cls, needs, directory)
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
