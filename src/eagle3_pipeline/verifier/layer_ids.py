"""Layer-id convention shared by every stage: vLLM's (docs/conventions.md, "Layer ids").

Id k < N is the residual stream entering decoder layer k (transformers' hidden_states[k]);
id N is the output of the LAST decoder layer before the final norm. transformers'
hidden_states[N] is after the norm and must never be stored as the "final" layer.
"""

from __future__ import annotations

from typing import Protocol

from eagle3_pipeline.errors import ParamsError


class _LayerChoice(Protocol):
    aux_layer_ids: list[int] | None
    final_layer_id: int | None


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3's default: an early, a middle and a late layer."""
    return [2, num_layers // 2, num_layers - 3]


def resolve_layer_ids(
    layers: _LayerChoice, num_layers: int, where: str = "params.yaml"
) -> tuple[list[int], int]:
    """Return (aux ids, final id) after checking them; raise ParamsError naming the field."""
    aux = list(layers.aux_layer_ids) if layers.aux_layer_ids is not None else None
    if aux is None:
        if num_layers < 7:
            raise ParamsError(
                f"{where}: layers.aux_layer_ids: the default [2, N//2, N-3] needs at least 7 "
                f"decoder layers, the verifier has {num_layers}: set layers.aux_layer_ids"
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
        raise ParamsError(f"{where}: layers.aux_layer_ids is empty: list at least one layer id")
    bad = [i for i in aux if not 0 <= i < num_layers]
    if bad:
        raise ParamsError(
            f"{where}: layers.aux_layer_ids {bad} out of range: ids must be in 0..{num_layers - 1} "
            f"for a verifier with {num_layers} decoder layers"
        )
    if len(set(aux)) != len(aux):
        raise ParamsError(
            f"{where}: layers.aux_layer_ids {aux} has duplicates: vLLM crashes on the first "
            "draft step with repeated ids; make them distinct"
        )
    return aux, final
