"""layer_ids: EAGLE-3's default aux ids and the final id, resolved for a verifier's depth."""

from __future__ import annotations


def test_default_layer_ids_resolve() -> None:
    from eagle3_pipeline.config.layer_ids import resolve_layer_ids
    from eagle3_pipeline.config.params import LayersParams

    assert resolve_layer_ids(LayersParams(), 8) == ([2, 4, 5], 8)
    assert resolve_layer_ids(LayersParams(), 61) == ([2, 30, 58], 61)


def test_the_store_holds_the_union_of_every_drafters_layers() -> None:
    """Without families' own ids the store keeps train's ids as written (its files unchanged);
    with them, the union ascending (vLLM returns layers sorted: online mode serves it too)."""
    from eagle3_pipeline.config.layer_ids import file_positions, store_aux_layer_ids
    from eagle3_pipeline.config.params import LayersParams

    assert store_aux_layer_ids(LayersParams(aux_layer_ids=[5, 2, 4]), 8) == [5, 2, 4]
    same = LayersParams(aux_layer_ids=[2, 4, 5], family_aux_layer_ids={"d": [4, 2]})
    assert store_aux_layer_ids(same, 8) == [2, 4, 5]
    more = LayersParams(aux_layer_ids=[5, 2, 4], family_aux_layer_ids={"d": [1, 3, 5, 7]})
    union = store_aux_layer_ids(more, 8)
    assert union == [1, 2, 3, 4, 5, 7]
    # Each drafter reads its own, in its own order; the final layer stays the file's last.
    assert file_positions(union, 8, [5, 2, 4], "s") == [4, 1, 3, 6]
    assert file_positions(union, 8, [1, 3, 5, 7], "s") == [0, 2, 4, 5, 6]


def test_a_familys_bad_ids_are_refused_naming_its_field() -> None:
    import pytest

    from eagle3_pipeline.config.layer_ids import file_positions, store_aux_layer_ids
    from eagle3_pipeline.config.params import LayersParams
    from eagle3_pipeline.core.errors import ParamsError, StoreError

    bad = LayersParams(aux_layer_ids=[2, 4, 5], family_aux_layer_ids={"dflash": [1, 8]})
    with pytest.raises(ParamsError, match=r"layers.family_aux_layer_ids.dflash \[8\] out of range"):
        store_aux_layer_ids(bad, 8)
    dup = LayersParams(aux_layer_ids=[2, 4, 5], family_aux_layer_ids={"dflash": [3, 3]})
    with pytest.raises(ParamsError, match=r"layers.family_aux_layer_ids.dflash \[3, 3\] has dup"):
        store_aux_layer_ids(dup, 8)
    with pytest.raises(StoreError, match=r"s: the store holds aux layers \[2, 4, 5\] \+ 8, not"):
        file_positions([2, 4, 5], 8, [1, 4], "s")
