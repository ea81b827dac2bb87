"""What a run's settings ask of vLLM, and the ways out a refusal names when vLLM falls short:
the setting that does without vLLM, vLLM's Transformers backend, and the hf extract backend
where transformers can build the verifier and its hooks find the decoder layers. The checks in
support.py decide; this module says who needs what and what to do instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from eagle3_pipeline.config.params import Params
from eagle3_pipeline.core.errors import VerifierError
from eagle3_pipeline.verifier import identity as vf
from eagle3_pipeline.verifier import loading

EAGLE3 = "SupportsEagle3"
# The architecture vLLM serves each drafter family as (speculators format; export.format flat:
# the legacy name), as vLLM 0.32's speculators config reader names them.
DRAFTER_ARCHITECTURES: dict[str, str] = {
    "eagle3": "Eagle3LlamaForCausalLM",
    "eagle3 (flat)": "LlamaForCausalLMEagle3",
    "peagle": "PeagleLlamaForCausalLM",
    "dflash": "DFlashDraftModel",
}


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


def model_impl(params: Params) -> str:
    """vLLM's --model-impl among vllm.extra_args (`auto` unless given)."""
    args = params.vllm.extra_args
    for i, arg in enumerate(args):
        if arg == "--model-impl" and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith("--model-impl="):
            return arg.split("=", 1)[1]
    return "auto"


def transformers_backend_runs(arch: str) -> bool:
    """vLLM's rule for running a transformers class through its Transformers backend."""
    try:
        import transformers

        cls = getattr(transformers, arch, None)
        return cls is not None and bool(
            cls.is_backend_compatible() or cls._can_set_attn_implementation()
        )
    except Exception:  # an older transformers without these methods: vLLM cannot either
        return False


def hf_capture(params: Params, directory: Path | None) -> str | None:
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


def without_vllm(needs: list[Need]) -> str:
    return ", ".join(n.instead for n in needs)


def unsupported(
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
    if model_impl(params) != "transformers" and transformers_backend_runs(arch):
        ways.append(
            "let vLLM's Transformers backend run it (it implements the interface): add "
            '"--model-impl", "transformers" to vllm.extra_args'
        )
    capture_needed = any(n.key.startswith(("extract.", "train.")) for n in users)
    why_not = hf_capture(params, directory) if capture_needed else None
    if why_not is None:
        ways.append(
            f"or train a drafter this vLLM cannot serve, measured offline only: "
            f"{without_vllm(users)}"
        )
    hf = f"; the hf extract backend cannot capture it either: {why_not}" if why_not else ""
    return VerifierError(
        f"{where}: vLLM {version}'s {cls} does not implement {EAGLE3}, so vLLM can neither "
        f"capture its aux hidden states nor serve a drafter beside it, which "
        f"{', '.join(n.key for n in users)} need (vLLM refuses only when it loads the model, "
        f"after generate ran in full): {'; '.join(ways)}{hf}"
    )
