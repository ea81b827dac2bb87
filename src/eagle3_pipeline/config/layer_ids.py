"""Layer-id convention shared by every stage: vLLM's (docs/conventions.md, "Layer ids").

Id k < N is the residual stream entering decoder layer k (transformers' hidden_states[k]);
id N is the output of the LAST decoder layer before the final norm. transformers'
hidden_states[N] is after the norm and must never be stored as the "final" layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from eagle3_pipeline.core.errors import ParamsError, StoreError


class _LayerChoice(Protocol):
    aux_layer_ids: list[int] | None
    final_layer_id: int | None


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3's default: an early, a middle and a late layer."""
    return [2, num_layers // 2, num_layers - 3]


def resolve_layer_ids(
    layers: _LayerChoice,
    num_layers: int,
    where: str = "params.yaml",
    field: str = "layers.aux_layer_ids",
) -> tuple[list[int], int]:
    """Return (aux ids, final id) after checking them; raise ParamsError naming the field."""
    aux = list(layers.aux_layer_ids) if layers.aux_layer_ids is not None else None
    if aux is None:
        if num_layers < 7:
            raise ParamsError(
                f"{where}: {field}: the default [2, N//2, N-3] needs at least 7 "
                f"decoder layers, the verifier has {num_layers}: set {field}"
            )
        aux = default_aux_layer_ids(num_layers)
    final = num_layers if layers.final_layer_id is None else layers.final_layer_id
    if final != num_layers:
        raise ParamsError(
            f"{where}: layers.final_layer_id={final} but the verifier has {num_layers} decoder "
            f"layers: the final id must equal num_hidden_layers ({num_layers}), the output of the "
            "last decoder layer before the final norm"
        )
    if not aux:
        raise ParamsError(f"{where}: {field} is empty: list at least one layer id")
    bad = [i for i in aux if not 0 <= i < num_layers]
    if bad:
        raise ParamsError(
            f"{where}: {field} {bad} out of range: ids must be in 0..{num_layers - 1} "
            f"for a verifier with {num_layers} decoder layers"
        )
    if len(set(aux)) != len(aux):
        raise ParamsError(
            f"{where}: {field} {aux} has duplicates: vLLM crashes on the first "
            "draft step with repeated ids; make them distinct"
        )
    return aux, final


class _StoreLayers(_LayerChoice, Protocol):
    family_aux_layer_ids: dict[str, list[int]]


def store_aux_layer_ids(
    layers: _StoreLayers, num_layers: int, where: str = "params.yaml"
) -> list[int]:
    """The aux ids extract captures: `layers.aux_layer_ids` as written when every family's
    ids are among them (a store without families stays as it was), else the union ascending
    (the order vLLM returns layers in, so online mode serves it too)."""
    aux, final = resolve_layer_ids(layers, num_layers, where)
    union = set(aux)
    for name, ids in layers.family_aux_layer_ids.items():
        own = _Choice(list(ids), final)
        union |= set(resolve_layer_ids(own, num_layers, where, family_field(name))[0])
    return aux if union == set(aux) else sorted(union)


def family_field(name: str) -> str:
    """The params field of family NAME's own aux ids."""
    return f"layers.family_aux_layer_ids.{name}"


def file_positions(store_aux: list[int], final: int, aux: list[int], where: str) -> list[int]:
    """Where a run's layers (`aux`, then the final) sit in a store file of `store_aux` + final.

    One line naming the missing ids when the store lacks any (its files were extracted for
    other layers)."""
    missing = [i for i in aux if i not in store_aux]
    if missing:
        raise StoreError(
            f"{where}: the store holds aux layers {store_aux} + {final}, not {missing} of the "
            f"run's {aux}: rerun extract (it captures layers.aux_layer_ids and every "
            "layers.family_aux_layer_ids)"
        )
    return [store_aux.index(i) for i in aux] + [len(store_aux)]


@dataclass(frozen=True)
class _Choice:
    aux_layer_ids: list[int]
    final_layer_id: int | None
