"""drafter/shape.py: the parameter formula against speculators 0.9.0's Eagle3DraftModel."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eagle3_pipeline.drafter import shape as drafter_shape


@pytest.mark.parametrize(
    ("norm_before_fc", "fc_norm", "attention_bias"),
    [(True, False, True), (False, False, False), (False, True, False)],
)
def test_parameter_formula_matches_speculators(
    tmp_path: Path, norm_before_fc: bool, fc_norm: bool, attention_bias: bool
) -> None:
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3SpeculatorConfig
    from speculators.models.eagle3.core import Eagle3DraftModel
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import LlamaConfig

    layer = LlamaConfig(
        vocab_size=1000,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        attention_bias=attention_bias,
    )
    layer._attn_implementation = "sdpa"
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer,
        draft_vocab_size=200,
        norm_before_fc=norm_before_fc,
        fc_norm=fc_norm,
        eagle_aux_hidden_state_layer_ids=[1, 3, 5, 6],
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=None, architectures=[]),
        ),
    )
    config.save_pretrained(str(tmp_path))
    model = Eagle3DraftModel(config)
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)

    shape = drafter_shape.drafter_from_init(
        json.loads((tmp_path / "config.json").read_text()), tmp_path
    )
    assert shape.aux_layer_ids == [1, 3, 5, 6] and shape.draft_vocab_size == 200
    frozen_head = drafter_shape.parameter_groups(shape, n_aux=4, train_lm_head=False)
    assert sum(g.count for g in frozen_head) == total
    assert sum(g.count for g in frozen_head if g.trainable) == trainable
    # train.train_lm_head un-freezes speculators' lm_head (speculators_compat._lm_head_trainable).
    with_head = drafter_shape.parameter_groups(shape, n_aux=4, train_lm_head=True)
    assert sum(g.count for g in with_head if g.trainable) == trainable + 200 * 64
