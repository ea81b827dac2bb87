"""The legacy flat EAGLE-3 layout, both ways: what SGLang, older vLLM and AQ-MedAI's drafters use.

speculators 0.9.0 converts flat -> speculators only (`speculators.convert.eagle`); `to_flat` is
its inverse, so that one trained drafter can be served by every server the users run.

Flat layout (`architectures: ["LlamaForCausalLMEagle3"]`): the Llama fields at the top level of
config.json plus `draft_vocab_size` and `eagle_config.eagle_aux_hidden_state_layer_ids`; tensors
`midlayer.*` (the one decoder layer), `fc`, `norm`, `lm_head`, `d2t`, `t2d` (and, when present,
`embed_tokens`, `input_norm`). speculators' converter renames `midlayer.` to `layers.0.` and
keeps every other name; vLLM's flat loader does the same (`hf_to_vllm_mapper`).

Aux-layer ids. Our ids are vLLM's (layer_ids.py): id k is the residual stream entering decoder
layer k. vLLM reads a draft config's ids as written, and its two model runners differ: both take
`eagle_aux_hidden_state_layer_ids` at the top level first; failing that, V1
(`GPUModelRunner._get_eagle3_aux_layers_from_config`) reads `eagle_config`'s key of that name and
Model Runner V2, which vLLM 0.32 picks on GPUs (`get_eagle3_aux_layers_from_config`,
v1/worker/gpu/spec_decode/eagle/eagle3_utils.py), reads only `eagle_config["layer_ids"]` and
otherwise serves the model's default layers. So a flat export writes our ids at the top level
(for vLLM, whichever runner) and the server's ids in `eagle_config`. SGLang reads only
`eagle_config.eagle_aux_hidden_state_layer_ids`
and captures before layer `id + 1` (`set_eagle3_layers_to_capture`: `[val + 1 for val in
layer_ids]`; llama.py appends `hidden_states + residual` before layer i when i is in
`layers_to_capture`), so its id s is our id s + 1. SpecForge (AQ-MedAI's trainer) captures the
output of layer s, the same convention as SGLang.

Flags. vLLM's flat loader (llama_eagle3.py) reads `norm_before_residual`, `norm_before_fc`
(top level or in `eagle_config`), `fc_norm` and `norm_output` from the top level, each False when
absent; the flat export writes all four explicitly so that vLLM computes the same function as
the speculators checkpoint. SGLang's LlamaForCausalLMEagle3 (sgl-project/sglang
python/sglang/srt/models/llama_eagle3.py, commits 03d5a77 and d737979) has none of them: it adds
the residual before hidden_norm, feeds `fc` un-normed, chains the pre-norm state, takes exactly 3
aux layers and 1 decoder layer, and silently ignores an `input_norm.weight`. A drafter that needs
any of them cannot be expressed there: `check_server` refuses it.

A flat file that this pipeline did not write (no `eagle3_pipeline.layer_convention`) is read as
SpecForge wrote it (docs/conventions.md, "Drafter config flags"): ids in SGLang's convention,
`fc_norm` as written, no norm before fc, and `norm_output` in SpecForge's meaning (absent or
true = logits from norm(h) with the pre-norm state chained, i.e. speculators' false; false = no
final norm, which neither speculators nor vLLM computes: refused). `read_conventions` is that
one reading.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from eagle3_pipeline.core.errors import CheckpointError
from eagle3_pipeline.drafter.conventions import (  # noqa: F401 (re-exported)
    FLAGS,
    Convention,
    read_conventions,
    vllm_layer_ids,
)

FLAT_ARCHITECTURE = "LlamaForCausalLMEagle3"
Server = Literal["vllm", "sglang"]
# transformer_layer_config keys that a flat config must not copy: they describe the HF object,
# not the drafter, or are rewritten below.
_NOT_COPIED = {
    "architectures",
    "rope_parameters",
    "rope_theta",
    "rope_scaling",
    "dtype",
    "torch_dtype",
    "transformers_version",
    "_attn_implementation",
    "auto_map",
}


def server_layer_ids(vllm_ids: list[int], server: Server, where: str = "export") -> list[int]:
    """Our (vLLM-convention) aux ids written the way `server` reads them."""
    if server == "vllm":
        return list(vllm_ids)
    if min(vllm_ids) < 1:
        raise CheckpointError(
            f"{where}: aux id 0 (the embeddings) has no SGLang id (SGLang captures before layer "
            "id + 1, so its lowest is our 1): pick aux_layer_ids >= 1 or export.server: vllm"
        )
    return [i - 1 for i in vllm_ids]


def check_server(
    flags: dict[str, bool],
    n_aux: int,
    n_layers: int,
    has_input_norm: bool,
    server: Server,
    where: str,
) -> None:
    """Refuse a drafter the server would load but compute differently (one line, the fix)."""
    if server == "vllm":
        return
    problems = [f"{k}=true" for k in FLAGS if flags.get(k)]
    if has_input_norm and "norm_before_fc=true" not in problems:
        problems.append("an input_norm weight")
    if n_aux != 3:
        problems.append(f"{n_aux} aux layers (SGLang's fc takes exactly 3)")
    if n_layers != 1:
        problems.append(f"{n_layers} decoder layers (SGLang's takes 1)")
    if problems:
        raise CheckpointError(
            f"{where}: export.server sglang cannot serve this drafter: it has "
            f"{', '.join(problems)}, which SGLang's LlamaForCausalLMEagle3 does not implement "
            "(residual before hidden_norm, no norm before fc, pre-norm state chained), so it "
            "would draft with a different function; use export.server: vllm, or train with "
            "norm_before_residual/norm_before_fc/norm_output false"
        )


# --- speculators -> flat ---------------------------------------------------------------------


def flat_tensor_name(name: str) -> str:
    """speculators name -> flat name (the inverse of speculators' `midlayer.` -> `layers.0.`)."""
    if name.startswith("layers.0."):
        return "midlayer." + name.removeprefix("layers.0.")
    return name


def speculators_tensor_name(name: str) -> str:
    """flat name -> speculators name, exactly as speculators' converter and vLLM rename it."""
    return name.replace("midlayer.", "layers.0.")


def to_flat_config(config: dict[str, Any], server: Server, where: str = "export") -> dict[str, Any]:
    """A speculators Eagle3 config.json as a flat config, aux ids in `server`'s convention."""
    tl = config["transformer_layer_config"]
    n_layers = int(tl.get("num_hidden_layers", 1))
    aux = config.get("eagle_aux_hidden_state_layer_ids")
    if not aux:
        raise CheckpointError(
            f"{where}: config.json has no eagle_aux_hidden_state_layer_ids: the flat format must "
            "name them (SGLang would fall back to its own defaults); re-export from a trained "
            "checkpoint"
        )
    if n_layers != 1:
        raise CheckpointError(
            f"{where}: {n_layers} decoder layers; the flat format holds one (midlayer): use "
            "export.format: speculators"
        )
    flat = {k: v for k, v in tl.items() if k not in _NOT_COPIED}
    rope = dict(tl.get("rope_parameters") or {})
    theta = rope.pop("rope_theta", tl.get("rope_theta", 10000.0))
    scaling = rope if rope and rope.get("rope_type", rope.get("type")) != "default" else None
    dtype = config.get("dtype") or tl.get("dtype") or "bfloat16"
    flat |= {
        "architectures": [FLAT_ARCHITECTURE],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "tie_word_embeddings": False,
        # Legacy rope fields: what SGLang, transformers 4.x and speculators' converter read.
        "rope_theta": theta,
        "rope_scaling": scaling,
        "torch_dtype": dtype,
        "dtype": dtype,
        "draft_vocab_size": config["draft_vocab_size"],
        # vLLM's ids at the top level, where both of its model runners look first: V1 then
        # reads eagle_config's key, Model Runner V2 never does (module docstring).
        "eagle_aux_hidden_state_layer_ids": list(aux),
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": server_layer_ids(aux, server, where),
            "use_aux_hidden_state": True,
        },
        # Explicit: vLLM's flat loader takes each as False when absent.
        **{k: bool(config.get(k, False)) for k in FLAGS},
    }
    if config.get("target_hidden_size") is not None:
        flat["target_hidden_size"] = config["target_hidden_size"]
    return flat


def to_flat_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {flat_tensor_name(k): v for k, v in tensors.items()}


def write_flat(
    src_dir: Path, out_dir: Path, server: Server, extra_config: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Write the flat form of the speculators checkpoint in `src_dir` into `out_dir`.

    `extra_config` is merged into config.json; `eagle3_pipeline.layer_convention` is set to
    `server` whatever it holds.

    `out_dir` is a fresh directory (the temp dir of `atomic.replace_dir`). Returns the config.
    """
    from safetensors.torch import load_file, save_file

    config = json.loads((src_dir / "config.json").read_text())
    if config.get("speculators_model_type") != "eagle3":
        raise CheckpointError(
            f"{src_dir}/config.json: speculators_model_type is "
            f"{config.get('speculators_model_type')!r}, not 'eagle3': rerun the train stage"
        )
    tensors = load_file(str(src_dir / "model.safetensors"))
    flat_config = to_flat_config(config, server, where=str(src_dir))
    check_server(
        {k: flat_config[k] for k in FLAGS},
        n_aux=len(flat_config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]),
        n_layers=1,
        has_input_norm="input_norm.weight" in tensors,
        server=server,
        where=str(src_dir),
    )
    flat_config |= extra_config or {}
    # Self-describing: a flat file without this record is read as SGLang's (open_checkpoint).
    record = dict(flat_config.get("eagle3_pipeline") or {})
    flat_config["eagle3_pipeline"] = record | {"layer_convention": server}
    weights = out_dir / "model.safetensors"
    save_file(to_flat_tensors(tensors), str(weights), metadata={"format": "pt"})
    weights.chmod(0o644)  # safetensors creates it private; outputs are shared with teammates
    (out_dir / "config.json").write_text(json.dumps(flat_config, indent=2, sort_keys=True) + "\n")
    return flat_config


# --- reading either format -------------------------------------------------------------------


@dataclass
class DrafterCheckpoint:
    """A drafter directory in either format; tensor names are given in speculators' naming."""

    path: Path
    format: Literal["flat", "speculators"]
    config: dict[str, Any]
    layer_config: dict[str, Any]
    aux_layer_ids: list[int] | None  # as written in the file
    convention: Convention  # of aux_layer_ids
    flags: dict[str, bool]
    _files: dict[str, Path] = field(default_factory=dict)  # speculators name -> file
    _file_names: dict[str, str] = field(default_factory=dict)  # speculators name -> name in file

    @property
    def hidden_size(self) -> int:
        return int(self.layer_config["hidden_size"])

    @property
    def target_hidden_size(self) -> int:
        return int(self.config.get("target_hidden_size") or self.hidden_size)

    @property
    def draft_vocab_size(self) -> int:
        return int(self.config.get("draft_vocab_size") or self.layer_config["vocab_size"])

    @property
    def target_vocab_size(self) -> int:
        return int(self.layer_config["vocab_size"])

    @property
    def vllm_aux_layer_ids(self) -> list[int] | None:
        if self.aux_layer_ids is None:
            return None
        return vllm_layer_ids(self.aux_layer_ids, self.convention)

    def names(self) -> list[str]:
        return sorted(self._files)

    def shape(self, name: str) -> list[int]:
        from safetensors import safe_open

        path = self._files[name]
        if path.suffix == ".bin":
            return list(self.tensor(name).shape)
        with safe_open(str(path), framework="pt") as f:
            return list(f.get_slice(self._file_names[name]).get_shape())

    def tensor(self, name: str) -> torch.Tensor:
        path = self._files[name]
        if path.suffix == ".bin":
            return _load_bin(path)[self._file_names[name]]
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            return f.get_tensor(self._file_names[name])


@functools.lru_cache(maxsize=1)
def _load_bin(path: Path) -> dict[str, torch.Tensor]:
    """A legacy pytorch_model.bin, read once for all its tensors."""
    return torch.load(path, map_location="cpu", weights_only=True)


def _weight_files(path: Path) -> dict[str, Path]:
    """name in file -> file, for model.safetensors, a sharded index, or pytorch_model.bin."""
    single = path / "model.safetensors"
    index = path / "model.safetensors.index.json"
    binary = path / "pytorch_model.bin"
    if single.is_file():
        from safetensors import safe_open

        with safe_open(str(single), framework="pt") as f:
            return dict.fromkeys(f.keys(), single)
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {k: path / v for k, v in weight_map.items()}
    if binary.is_file():
        return dict.fromkeys(_load_bin(binary), binary)
    raise CheckpointError(
        f"{path}: no model.safetensors, model.safetensors.index.json or pytorch_model.bin: point "
        "train.init_from at a drafter directory"
    )


def open_checkpoint(path: str | Path) -> DrafterCheckpoint:
    """Read a drafter directory in the flat or speculators format (config + tensor index)."""
    path = Path(path)
    config_path = path / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{config_path}: not found: point train.init_from at a drafter dir")
    config = json.loads(config_path.read_text())
    files = _weight_files(path)
    is_flat = config.get("speculators_model_type") is None
    if is_flat and not (
        FLAT_ARCHITECTURE in (config.get("architectures") or [])
        or any(k.startswith("midlayer.") for k in files)
    ):
        raise CheckpointError(
            f"{config_path}: neither a speculators drafter (speculators_model_type) nor a flat "
            f"EAGLE-3 drafter (architectures {config.get('architectures')}): point "
            "train.init_from at an EAGLE-3 drafter directory"
        )
    conv = read_conventions(config, config_path)
    fmt: Literal["flat", "speculators"] = "flat" if is_flat else "speculators"
    layer_config = config if is_flat else config["transformer_layer_config"]
    aux, convention, flags = conv.aux_layer_ids, conv.convention, conv.flags
    ckpt = DrafterCheckpoint(
        path=path,
        format=fmt,
        config=config,
        layer_config=layer_config,
        aux_layer_ids=list(aux) if aux else None,
        convention=convention,
        flags=flags,
    )
    for file_name, file in files.items():
        name = speculators_tensor_name(file_name) if fmt == "flat" else file_name
        ckpt._files[name] = file  # noqa: SLF001
        ckpt._file_names[name] = file_name  # noqa: SLF001
    return ckpt


def to_speculators_config(flat: dict[str, Any], verifier_name_or_path: str) -> dict[str, Any]:
    """A flat config.json as a speculators Eagle3 config dict (the inverse of `to_flat_config`).

    Ids (in our vLLM convention) and flags (in vLLM's meaning) as `read_conventions` reads them.
    """
    conv = read_conventions(flat, "flat config.json")
    aux = conv.vllm_aux_layer_ids
    return {
        "architectures": ["Eagle3DraftModel"],
        "speculators_model_type": "eagle3",
        "transformer_layer_config": conv.layer_config,
        "draft_vocab_size": conv.draft_vocab_size,
        "target_hidden_size": conv.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": aux,
        **conv.flags,
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
            "verifier": {"name_or_path": verifier_name_or_path, "architectures": []},
        },
    }
