"""DFlash's offline simulation (evaluation.parallel_offline) against speculators' own alignment of
a block's slots with the verifier's tokens, on a DFlash drafter trained by speculators."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from train_workspace import build_run_inputs, train_tiny

from eagle3_pipeline.config.families import FamilyParams
from eagle3_pipeline.drafter.load import load_parallel_drafter
from eagle3_pipeline.evaluation import offline, parallel_offline

pytestmark = pytest.mark.slow
BLOCK, MASK = 4, 500


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return build_run_inputs(tmp_path_factory.mktemp("inputs"))


@pytest.fixture(scope="module")
def dflash(inputs: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Any:
    run = tmp_path_factory.mktemp("dflash")
    family = FamilyParams(name="dflash", block_size=BLOCK, num_layers=1, mask_token_id=MASK)
    train_tiny(inputs, run, family=family, mask_token_id=MASK, epochs=1)
    return load_parallel_drafter(run / "ckpt" / "0", inputs["root"] / "verifier")


def _sample(inputs: dict[str, Any], i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    s = inputs["samples"][i]
    raw = load_file(s["hidden_states_file"])
    return raw["hidden_states"].float(), raw["token_ids"], torch.tensor(s["loss_mask"])


def test_the_loaded_drafter_shares_the_verifiers_embeddings(
    dflash: Any, inputs: dict[str, Any]
) -> None:
    """DFlash checkpoints omit embed_tokens: loading must read them from the verifier."""
    verifier = load_file(inputs["root"] / "verifier" / "model.safetensors")
    rows = verifier["model.embed_tokens.weight"].to(torch.bfloat16).float()
    assert torch.equal(dflash.embed_tokens.weight.float(), rows)


def test_slots_line_up_with_speculators_own_targets(dflash: Any, inputs: dict[str, Any]) -> None:
    """speculators' anchored-block pass aligns each slot with its target itself (targets,
    aligned mask). Where the verifier's greedy token is in the draft vocab, our row for that
    anchor says accepted exactly when speculators' prediction equals its target; elsewhere it
    says rejected (the verifier emits a token the drafter cannot)."""
    head = offline.VerifierHead(inputs["root"] / "verifier", 1e-6, torch.device("cpu"))
    t2d = dflash.t2d.cpu()
    checked = in_vocab_accepted = 0
    for i in range(6):
        hs, ids, mask = _sample(inputs, i)
        greedy = head.greedy(hs[:, -1])
        ok = parallel_offline.dflash_matches(dflash, hs, ids, greedy, BLOCK - 1)
        with torch.no_grad():
            _, logits, targets, aligned, indices = dflash._backbone_forward(
                hs[:, :-1].flatten(1).unsqueeze(0),
                ids.unsqueeze(0),
                mask.unsqueeze(0),
                hs[:, -1].unsqueeze(0),
                torch.zeros(1, len(ids), dtype=torch.long),
                max_anchors=len(ids),
            )
        theirs = (logits.argmax(-1) == targets.argmax(-1))[0].view(-1, BLOCK)
        slots = aligned[0].view(-1, BLOCK).bool()
        for row, anchor in enumerate(indices.view(-1, BLOCK)[:, 0].tolist()):
            for j in range(1, BLOCK):
                if not slots[row, j]:
                    continue
                checked += 1
                token = int(greedy[anchor + j - 1])  # the verifier's token at anchor + j
                if t2d[token]:
                    assert bool(ok[anchor - 1, j - 1]) == bool(theirs[row, j]), (i, anchor, j)
                    in_vocab_accepted += int(ok[anchor - 1, j - 1])
                else:
                    assert not ok[anchor - 1, j - 1]
    assert checked > 300 and in_vocab_accepted > 0


def test_chunks_and_limits(dflash: Any, inputs: dict[str, Any]) -> None:
    hs, ids, _ = _sample(inputs, 0)
    head = offline.VerifierHead(inputs["root"] / "verifier", 1e-6, torch.device("cpu"))
    greedy = head.greedy(hs[:, -1])
    whole = parallel_offline.dflash_matches(dflash, hs, ids, greedy, BLOCK - 1)
    assert whole.shape == (len(ids) - 1, BLOCK - 1)
    assert torch.equal(whole, parallel_offline.dflash_matches(dflash, hs, ids, greedy, 3, 5))
    assert not whole[-1].any() and not whole[-2, 1:].any()  # nothing past the sequence's end
    with pytest.raises(ValueError, match="DFlash block 4 drafts 3 tokens, not 4"):
        parallel_offline.dflash_matches(dflash, hs, ids, greedy, BLOCK)


def test_fewer_drafts_is_a_shorter_block(
    dflash: Any, inputs: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM queries the anchor and as many mask slots as it drafts: the pass runs with that
    block, and the drafter keeps its trained one afterwards."""
    hs, ids, _ = _sample(inputs, 0)
    greedy = offline.VerifierHead(inputs["root"] / "verifier", 1e-6).greedy(hs[:, -1])
    blocks: list[int] = []
    forward = dflash._backbone_forward

    def spy(*args: Any, **kwargs: Any) -> Any:
        blocks.append(dflash.block_size)
        return forward(*args, **kwargs)

    monkeypatch.setattr(dflash, "_backbone_forward", spy)
    two = parallel_offline.dflash_matches(dflash, hs, ids, greedy, 2)
    assert two.shape == (len(ids) - 1, 2) and set(blocks) == {3} and dflash.block_size == BLOCK
