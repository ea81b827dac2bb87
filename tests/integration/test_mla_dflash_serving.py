"""vLLM on CPU serves a DFlash drafter beside the tiny-dsv3 MLA verifier (docs/families.md).

The drafter is the one a `dflash` families branch starts from on this verifier: built by
speculators' own `build_draft_model` (`training.run.initial_drafter`), saved in speculators'
format, served with `method: dflash` beside the verifier's MLA attention. Untrained, it drafts
and is almost never accepted; what the test proves is that vLLM loads and runs it there, and that
greedy outputs stay the verifier's own.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from train_workspace import tiny_settings
from verifiers import mla_server_spec

from eagle3_pipeline.config.families import FamilyParams
from eagle3_pipeline.evaluation import online as oe
from eagle3_pipeline.evaluation import paired
from eagle3_pipeline.serving.server import serve_many
from eagle3_pipeline.training.run import initial_drafter
from eagle3_pipeline.verifier import identity as vf

K = 3  # DFlash block 4 drafts 3 tokens per pass
PROMPTS = ["Why is the sky blue?", "Name three rivers in Europe."]


def _dflash_drafter(verifier: Path, root: Path) -> Path:
    """An untrained DFlash drafter over the full vocab, reading vLLM's ids [1, 2] (id 0, the
    embeddings, vLLM cannot capture on DeepSeek-V3 models)."""
    vocab = int(vf.text_config(vf.read_config(verifier))["vocab_size"])
    np.save(root / "t2d.npy", np.ones(vocab, dtype=bool))
    np.save(root / "d2t.npy", np.zeros(vocab, dtype=np.int64))
    settings = tiny_settings(  # data_dir is not read: nothing is trained
        {"root": root},
        root,
        verifier_dir=verifier,
        draft_vocab_size=vocab,
        target_layer_ids=[1, 2],
        family=FamilyParams(name="dflash", block_size=K + 1, num_layers=1, mask_token_id=1),
        mask_token_id=1,
    )
    model = initial_drafter(settings)
    assert type(model).__name__ == "DFlashDraftModel"
    model.save_pretrained(root / "drafter")
    return root / "drafter"


@pytest.mark.vllm
def test_dflash_drafter_served_beside_mla_verifier_is_lossless(
    tiny_dsv3_verifier_dir: Path, tmp_path: Path
) -> None:
    drafter = _dflash_drafter(tiny_dsv3_verifier_dir, tmp_path)
    base = mla_server_spec(tiny_dsv3_verifier_dir, tmp_path / "vllm.log")
    baseline_spec, dflash_spec = oe.server_specs(base, drafter, K, tmp_path, family="dflash")
    settings = oe.Settings(num_speculative_tokens=K, max_new_tokens=48, chat_template_kwargs={})
    conversations = [[{"role": "user", "content": p}] for p in PROMPTS]
    with serve_many([baseline_spec, dflash_spec]) as (baseline_url, dflash_url):
        baseline = oe.measure(baseline_url, conversations, settings)
        drafted = oe.measure(dflash_url, conversations, settings)

    log = dflash_spec.log_file.read_text()
    assert "Resolved architecture: DFlashDraftModel" in log
    assert f"SpeculativeConfig(method='dflash', model='{drafter}', num_spec_tokens={K})" in log
    section = oe.online_section(baseline, drafted, K)
    assert section["num_drafts"] > 0, section
    assert section["num_draft_tokens"] == K * section["num_drafts"], section
    verdict = paired.verdict([str(i) for i in range(len(PROMPTS))], baseline, drafted, settings)
    assert verdict.outcome == "identical", verdict
