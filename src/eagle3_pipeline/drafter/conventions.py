"""The drafter's conventions: which verifier layers `fc` reads and how its norms are wired.

A drafter's tensors mean something only with the features and wiring they were trained with
(docs/conventions.md, "Drafter config flags"). `read_conventions` reads what a
drafter config.json says, by the tool that wrote it; `run_conventions` is THE place that decides
the run's conventions from params and, with `train.init_from`, from the init checkpoint: train
(TrainSettings -> speculators), export (the config flags, written once), evaluate and plan all
read it. With an init checkpoint the run adopts the checkpoint's flags and decoder layer shape
(heads, sizes, rope, eps); an explicit param that differs from it (`layers.aux_layer_ids`, a
`train.flags.*` that is not null) is refused, naming both values, unless `train.init_mismatch:
allow` says those tensors are to be retrained. Layer ids are never adopted silently: extract
stores what `layers` names (and DVC tracks it), so the profile writes the checkpoint's ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from eagle3_pipeline.config.layer_ids import resolve_layer_ids
from eagle3_pipeline.config.params import LayersParams
from eagle3_pipeline.config.training_params import TrainParams
from eagle3_pipeline.core import readers
from eagle3_pipeline.core.errors import CheckpointError

Convention = Literal["vllm", "sglang"]
FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")
# speculators 0.9's trainer for eagle3 (train/config/schema.py: norm_before_residual defaults to
# True; norm_before_fc and norm_output resolve to True for eagle3; fc_norm False).
TRAINER_DEFAULT_FLAGS = {
    "norm_before_residual": True,
    "norm_before_fc": True,
    "fc_norm": False,
    "norm_output": True,
}
# Decoder-layer fields that change a tensor's shape; export checks them against the run's.
LAYER_SHAPE_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
)


def vllm_layer_ids(ids: list[int], convention: Convention) -> list[int]:
    """Ids written in `convention`, as our (vLLM-convention) ids."""
    return list(ids) if convention == "vllm" else [i + 1 for i in ids]


Origin = Literal["speculators", "pipeline", "specforge"]


@dataclass(frozen=True)
class CheckpointConventions:
    """What a drafter's tensors mean, from its config.json alone (the plan has no weights).

    `flags` are in speculators'/vLLM's meaning whatever tool wrote the file; `layer_config` is
    the decoder layer as a speculators `transformer_layer_config` (heads, sizes, rope, eps).
    """

    origin: Origin
    aux_layer_ids: list[int] | None  # as written in the file
    convention: Convention  # of aux_layer_ids
    flags: dict[str, bool]
    layer_config: dict[str, Any]
    draft_vocab_size: int
    target_hidden_size: int | None

    @property
    def vllm_aux_layer_ids(self) -> list[int] | None:
        if self.aux_layer_ids is None:
            return None
        return vllm_layer_ids(self.aux_layer_ids, self.convention)

    @property
    def hidden_size(self) -> int:
        return int(self.layer_config["hidden_size"])

    def describe_ids(self) -> str:
        """The ids in vLLM's convention, and as written when that differs."""
        ids = self.vllm_aux_layer_ids
        if self.convention == "vllm" or ids is None:
            return str(ids)
        return f"{ids} (written {self.aux_layer_ids} in SGLang's convention)"


def _specforge_flags(config: dict[str, Any], where: str) -> dict[str, bool]:
    """A SpecForge/SGLang flat config's flags in speculators' meaning (see the module doc)."""
    eagle_config = config.get("eagle_config") or {}
    if config.get("norm_output", True) is False:
        raise CheckpointError(
            f"{where}: norm_output false: in SpecForge that drafter takes logits from the "
            "un-normed state, which speculators and vLLM never compute (they always norm before "
            "lm_head): use a drafter trained with SpecForge's default norm_output"
        )
    return {
        "norm_before_residual": bool(config.get("norm_before_residual", False)),
        "norm_before_fc": bool(
            config.get("norm_before_fc", eagle_config.get("norm_before_fc", False))
        ),
        "fc_norm": bool(config.get("fc_norm", False)),
        "norm_output": False,
    }


def _flat_layer_config(flat: dict[str, Any]) -> dict[str, Any]:
    """A flat config's Llama fields as a speculators transformer_layer_config."""
    skip = {"eagle_config", "draft_vocab_size", "target_hidden_size", "eagle3_pipeline", *FLAGS}
    skip.add("eagle_aux_hidden_state_layer_ids")
    tl = {k: v for k, v in flat.items() if k not in skip | {"architectures", "torch_dtype"}}
    tl["architectures"] = ["LlamaForCausalLM"]
    tl.pop("rope_theta", None)
    tl.pop("rope_scaling", None)
    rope = {"rope_theta": flat.get("rope_theta", 10000.0), "rope_type": "default"}
    rope |= flat.get("rope_scaling") or {}
    tl["rope_parameters"] = rope
    return tl


def read_conventions(config: dict[str, Any], where: str | Path) -> CheckpointConventions:
    """The conventions of a drafter config.json in either format, by the tool that wrote it."""
    where = str(where)
    if config.get("speculators_model_type") is not None:
        if config["speculators_model_type"] != "eagle3":
            raise CheckpointError(
                f"{where}: speculators_model_type {config['speculators_model_type']!r}; "
                "only eagle3 drafters can initialise this run"
            )
        layer = config.get("transformer_layer_config")
        if not isinstance(layer, dict):
            raise CheckpointError(f"{where}: no transformer_layer_config: re-save the drafter")
        aux = config.get("eagle_aux_hidden_state_layer_ids")
        return CheckpointConventions(
            origin="speculators",
            aux_layer_ids=list(aux) if aux else None,
            convention="vllm",
            # vLLM reads an absent norm_before_residual as true (speculators/algos.py).
            flags={k: bool(config.get(k, k == "norm_before_residual")) for k in FLAGS},
            layer_config=dict(layer),
            draft_vocab_size=int(config.get("draft_vocab_size") or layer["vocab_size"]),
            target_hidden_size=config.get("target_hidden_size"),
        )
    eagle_config = config.get("eagle_config") or {}
    aux = eagle_config.get("eagle_aux_hidden_state_layer_ids") or config.get(
        "eagle_aux_hidden_state_layer_ids"
    )
    ours = (config.get("eagle3_pipeline") or {}).get("layer_convention")
    if ours in ("vllm", "sglang"):  # our own flat export: flags written in vLLM's meaning
        origin: Origin = "pipeline"
        convention: Convention = ours
        flags = {k: bool(config.get(k, eagle_config.get(k, False))) for k in FLAGS}
        top = config.get("eagle_aux_hidden_state_layer_ids")  # vLLM's ids, for both runners
        in_eagle = eagle_config.get("eagle_aux_hidden_state_layer_ids")
        if top and in_eagle and list(top) != vllm_layer_ids(list(in_eagle), ours):
            raise CheckpointError(
                f"{where}: eagle_aux_hidden_state_layer_ids {list(top)} (vLLM's, top level) "
                f"disagree with eagle_config's {list(in_eagle)} in {ours}'s convention: "
                "re-run the export stage"
            )
        aux = in_eagle or top
    else:
        origin, convention, flags = "specforge", "sglang", _specforge_flags(config, where)
    if "hidden_size" not in config or "vocab_size" not in config:
        raise CheckpointError(
            f"{where}: no hidden_size/vocab_size: is this an EAGLE-3 drafter config.json?"
        )
    return CheckpointConventions(
        origin=origin,
        aux_layer_ids=list(aux) if aux else None,
        convention=convention,
        flags=flags,
        layer_config=_flat_layer_config(config),
        draft_vocab_size=int(config.get("draft_vocab_size") or config["vocab_size"]),
        target_hidden_size=config.get("target_hidden_size"),
    )


def read_init_config(path: str | Path) -> tuple[dict[str, Any], Path]:
    """(config, its file) of an init drafter: a directory holding config.json, or the file."""
    path = Path(path)
    file = path if path.suffix == ".json" and not path.is_dir() else path / "config.json"
    fix = "point train.init_from at a drafter directory (or pass --init-config PATH)"
    return readers.read_json_object(file, CheckpointError, fix), file


@dataclass(frozen=True)
class RunConventions:
    """The run's drafter: aux/final ids (vLLM's convention), norm flags (vLLM's meaning) and,
    with an init checkpoint, its decoder layer config (else speculators builds one from the
    verifier). `retrained` lists the params that differ from the checkpoint (init_mismatch
    allow); `sources` says where each flag came from."""

    aux_layer_ids: list[int]
    final_layer_id: int
    flags: dict[str, bool]
    sources: dict[str, str]
    layer_config: dict[str, Any] | None = None
    init: CheckpointConventions | None = None
    init_file: Path | None = None
    retrained: tuple[str, ...] = ()

    def describe(self) -> str:
        """One line: the flags and where they come from."""
        flags = ", ".join(
            f"{k} {str(v).lower()} ({self.sources[k]})" for k, v in self.flags.items()
        )
        shape = "init checkpoint" if self.layer_config is not None else "verifier + speculators"
        return f"{flags}; decoder layer from the {shape}"


def _value(v: Any) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)


def resolve(
    layers: LayersParams,
    train: TrainParams,
    num_layers: int,
    init: tuple[dict[str, Any], Path] | None,
    where: str = "params.yaml",
) -> RunConventions:
    """The run's conventions from params' `layers` and `train` and the init checkpoint's config
    (module doc)."""
    aux, final = resolve_layer_ids(layers, num_layers, where=where)
    explicit = train.flags.model_dump()
    if init is None:
        flags = {k: TRAINER_DEFAULT_FLAGS[k] if v is None else v for k, v in explicit.items()}
        sources = {k: "speculators default" if v is None else "params" for k, v in explicit.items()}
        # A family that is defined by its wiring (EAGLE-3.1) sets it over train.flags, which
        # every families branch shares with train's drafter.
        family = train.family
        fixed = family.wiring()
        flags |= fixed
        sources |= dict.fromkeys(fixed, f"family {family.name}")
        _check_flags(flags, where)
        return RunConventions(aux, final, flags, sources)
    config, file = init
    ck = read_conventions(config, file)
    if ck.target_hidden_size not in (None, ck.hidden_size):
        raise CheckpointError(
            f"{file}: target_hidden_size {ck.target_hidden_size} differs from hidden_size "
            f"{ck.hidden_size}: speculators 0.9 builds fc for aux layers of hidden_size and "
            "cannot train this drafter; use a drafter whose verifier width equals its own"
        )
    differ: list[str] = []
    ck_aux = ck.vllm_aux_layer_ids
    if ck_aux is not None and ck_aux != aux:
        differ.append(f"layers.aux_layer_ids {aux} vs the checkpoint's {ck.describe_ids()}")
    flags, sources = {}, {}
    for k, v in explicit.items():
        flags[k] = ck.flags[k] if v is None else v
        sources[k] = "init checkpoint" if v is None else "params"
        if v is not None and v != ck.flags[k]:
            differ.append(f"train.flags.{k} {_value(v)} vs the checkpoint's {_value(ck.flags[k])}")
    _check_flags(flags, where)
    if differ and train.init_mismatch == "refuse":
        raise CheckpointError(
            f"{where}: params differ from the init checkpoint {file} ({'; '.join(differ)}): its "
            "tensors were trained with the checkpoint's values; write those (a null train.flags "
            "entry adopts the checkpoint's), or set train.init_mismatch: allow to retrain them"
        )
    return RunConventions(aux, final, flags, sources, ck.layer_config, ck, file, tuple(differ))


def _check_flags(flags: dict[str, bool], where: str) -> None:
    if flags["norm_before_fc"] and flags["fc_norm"]:
        raise CheckpointError(
            f"{where}: norm_before_fc and fc_norm both true: speculators and vLLM take one norm "
            "before fc or per-layer norms, not both; set one of train.flags.norm_before_fc / "
            "fc_norm to false"
        )


def run_conventions(
    layers: LayersParams, train: TrainParams, num_layers: int, where: str = "params.yaml"
) -> RunConventions:
    """The conventions of this run, reading `train.init_from`'s config.json when set."""
    init = read_init_config(train.init_from) if train.init_from else None
    return resolve(layers, train, num_layers, init, where)
