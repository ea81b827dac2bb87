"""P-EAGLE's offline simulation (evaluation.parallel_offline) against speculators' own training
forward, on a P-EAGLE drafter trained by speculators: the same logits for the same (anchor,
depth) sample, and each row's verdict lined up with the forward's own targets."""

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
DEPTHS, MASK = 3, 500


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return build_run_inputs(tmp_path_factory.mktemp("inputs"))


@pytest.fixture(scope="module")
def peagle(inputs: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Any:
    run = tmp_path_factory.mktemp("peagle")
    family = FamilyParams(name="peagle", num_depths=DEPTHS, mask_token_id=MASK)
    train_tiny(inputs, run, family=family, mask_token_id=MASK, epochs=1)
    return load_parallel_drafter(run / "ckpt" / "0", inputs["root"] / "verifier", family="peagle")


def _sample(inputs: dict[str, Any], i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    s = inputs["samples"][i]
    raw = load_file(s["hidden_states_file"])
    return raw["hidden_states"].float(), raw["token_ids"], torch.tensor(s["loss_mask"])


def _speculators_forward(
    model: Any, hs: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor, monkeypatch: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logits, targets, anchor, depth) of PEagleDraftModel.forward on the shifted sample, its
    COD sample replaced by every (anchor, depth) pair that stays inside the sequence."""
    import speculators.models.peagle.core as core

    rows = len(ids) - 1
    spans = [torch.arange(rows)] + [torch.arange(rows - d) for d in range(1, DEPTHS)]
    anchor = torch.cat(spans)
    depth = torch.cat([torch.full((len(x),), d) for d, x in enumerate(spans)])
    seen: dict[str, torch.Tensor] = {}

    def capture(logits: torch.Tensor, targets: torch.Tensor, **_: Any) -> tuple[Any, dict]:
        seen["logits"], seen["targets"] = logits[0], targets[0]
        return torch.zeros(()), {}

    monkeypatch.setattr(core, "generate_cod_sample_indices", lambda **_: (anchor, depth))
    monkeypatch.setattr(core, "compute_metrics", capture)
    with torch.no_grad():
        model(
            hidden_states=hs[:-1, :-1].flatten(1).unsqueeze(0),
            input_ids=ids[1:].unsqueeze(0),
            document_ids=torch.zeros(1, rows, dtype=torch.long),
            loss_mask=mask[1:].float().unsqueeze(0),
            verifier_last_hidden_states=hs[1:, -1].unsqueeze(0),
            num_depths=DEPTHS,
        )
    return seen["logits"], seen["targets"], anchor, depth


def test_the_pass_is_speculators_forward(
    peagle: Any, inputs: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Same sample in, same logits out: the simulation drafts with the function trained."""
    hs, ids, mask = _sample(inputs, 0)
    theirs, _, anchor, depth = _speculators_forward(peagle, hs, ids, mask, monkeypatch)
    aux = hs[:-1, :-1].flatten(1)
    with torch.no_grad():
        ours = parallel_offline.peagle_logits(peagle, aux, ids[1:], anchor, depth)
    assert ours.shape == theirs.shape and theirs.shape[0] > 2 * len(ids)
    torch.testing.assert_close(ours, theirs)


def test_rows_line_up_with_speculators_own_targets(
    peagle: Any, inputs: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the verifier's greedy token is in the draft vocab, row a's depth d says accepted
    exactly when the forward's prediction equals its own target for (a, d); elsewhere it says
    rejected (the verifier emits a token the drafter cannot)."""
    head = offline.VerifierHead(inputs["root"] / "verifier", 1e-6, torch.device("cpu"))
    t2d = peagle.t2d.cpu()
    checked = accepted = deep_accepted = 0
    for i in range(4):
        hs, ids, mask = _sample(inputs, i)
        greedy = head.greedy(hs[:, -1])
        ok = parallel_offline.peagle_matches(peagle, hs, ids, greedy, DEPTHS)
        assert ok.shape == (len(ids) - 1, DEPTHS)
        logits, targets, anchor, depth = _speculators_forward(peagle, hs, ids, mask, monkeypatch)
        hits = logits.argmax(-1) == targets.argmax(-1)
        for a, d, hit in zip(anchor.tolist(), depth.tolist(), hits.tolist(), strict=True):
            if a + d + 2 >= len(ids):
                continue  # proposes past the end: always rejected, nothing to compare
            checked += 1
            if t2d[int(greedy[a + d + 1])]:  # the verifier's token at a + d + 2
                assert bool(ok[a, d]) == hit, (i, a, d)
                accepted += int(hit)
                deep_accepted += int(hit and d > 0)
            else:
                assert not ok[a, d]
    assert checked > 300 and accepted > 0 and deep_accepted > 0


def test_chunks_and_the_end(peagle: Any, inputs: dict[str, Any]) -> None:
    hs, ids, _ = _sample(inputs, 1)
    head = offline.VerifierHead(inputs["root"] / "verifier", 1e-6, torch.device("cpu"))
    greedy = head.greedy(hs[:, -1])
    whole = parallel_offline.peagle_matches(peagle, hs, ids, greedy, DEPTHS)
    assert torch.equal(whole, parallel_offline.peagle_matches(peagle, hs, ids, greedy, DEPTHS, 7))
    assert not whole[-1].any() and not whole[-2, 1:].any()  # nothing past the sequence's end
    fewer = parallel_offline.peagle_matches(peagle, hs, ids, greedy, 2)
    assert torch.equal(fewer, whole[:, :2])  # a slot's draft does not see deeper slots
