"""layer_ids: EAGLE-3's default aux ids and the final id, resolved for a verifier's depth."""

from __future__ import annotations


def test_default_layer_ids_resolve() -> None:
    from eagle3_pipeline.params import LayersParams
    from eagle3_pipeline.verifier.layer_ids import resolve_layer_ids

    assert resolve_layer_ids(LayersParams(), 8) == ([2, 4, 5], 8)
    assert resolve_layer_ids(LayersParams(), 61) == ([2, 30, 58], 61)
