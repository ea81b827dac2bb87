"""evaluation/probe.py (`eagle3 probe-layers`): a SpecForge-style drafter trained on vLLM ids
[2, 4, 5] (published_drafter.py), probed through the hf extract backend on the verifier's own
greedy answers: the ids it was trained on score higher than the same ids one layer early."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from published_drafter import (
    PUBLISHED_AUX,
    SGLANG_AUX,
    VOCAB,
    draft_vocab,
    run_params,
    save_legacy_flat,
    sharp_verifier,
    train_published,
    verifier_samples,
)

from eagle3_pipeline.cli import main
from eagle3_pipeline.core.errors import ParamsError
from eagle3_pipeline.evaluation import probe

N_SAMPLES = 12


@pytest.fixture(scope="module")
def published(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("probe")
    verifier = sharp_verifier(root / "verifier")
    samples = verifier_samples(verifier, N_SAMPLES, new=32)
    target_ids = draft_vocab(samples, root / "vocab", VOCAB)
    model = train_published(verifier, target_ids, samples, steps=30, lr=1e-2)
    return {
        "verifier": verifier,
        "flat": save_legacy_flat(model, root / "published", SGLANG_AUX),
        "samples": samples,
    }


@pytest.fixture
def workspace(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, published: dict) -> Path:
    """data/tokenized/{val,train}.jsonl of the verifier's greedy answers, as tokenize writes."""
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "data/tokenized"
    out.mkdir(parents=True)
    rows = [
        {
            "id": f"s{i:02d}",
            "split": "val",
            "input_ids": s.ids.tolist(),
            "loss_mask": s.mask.tolist(),
        }
        for i, s in enumerate(published["samples"])
    ]
    (out / "val.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (out / "train.jsonl").write_text("")
    return tmp_path


def test_trained_ids_beat_shifted_ids(workspace: Path, published: dict, capsys) -> None:
    params = run_params(published["verifier"], published["flat"], PUBLISHED_AUX)
    shifted = [i - 1 for i in PUBLISHED_AUX]
    got = probe.run(params, [shifted, PUBLISHED_AUX], samples=N_SAMPLES, backend="hf")
    right, wrong = got["2,4,5"], got["1,3,4"]
    assert right["num_drafts"] == wrong["num_drafts"] > 0
    # measured: 3.216 vs 3.039 (the random verifier's repetition loops are easy at any layer)
    assert right["mean_acceptance_length"] > wrong["mean_acceptance_length"] + 0.1, got
    out = capsys.readouterr().out
    assert "ids 2,4,5 + 8:" in out and out.count("<- best") == 1
    assert [x for x in out.splitlines() if "<- best" in x][0].startswith("[probe-layers] ids 2,4,5")
    assert not (workspace / "data/.work/probe").exists()  # scratch removed


def test_cli_runs_the_probe(workspace: Path, published: dict, capsys) -> None:
    params = run_params(published["verifier"], published["flat"], PUBLISHED_AUX)
    path = workspace / "params.yaml"
    path.write_text(json.dumps(params.model_dump(mode="json")))
    rc = main(["probe-layers", "--params", str(path), "--ids", "2,4,5", "--samples", "2"])
    assert rc == 0
    assert "ids 2,4,5 + 8: simulated mean acceptance length" in capsys.readouterr().out


def test_id_sets_are_checked(workspace: Path, published: dict) -> None:
    params = run_params(published["verifier"], published["flat"], PUBLISHED_AUX)
    with pytest.raises(ParamsError, match=r"--ids 2,4: 2 ids, but the drafter .* reads 3"):
        probe.run(params, [[2, 4]], samples=2, backend="hf")
    with pytest.raises(ParamsError, match=r"layer ids must lie in \[0, 8\)"):
        probe.run(params, [[2, 4, 8]], samples=2, backend="hf")
    with pytest.raises(ParamsError, match="expected distinct"):
        probe.parse_ids("2,2,4")
    with pytest.raises(ParamsError, match="set train.init_from"):
        probe.run(
            params.model_copy(
                update={"train": params.train.model_copy(update={"init_from": None})}
            ),
            [[2, 4, 5]],
        )
