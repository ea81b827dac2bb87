"""generate grows by rows: prompts added, changed and removed after a run cost only the requests
of the new and changed ones, from what a teammate has (the published rows, in the workspace or
only in the DVC cache, without the scratch journal), and the output equals a run from scratch."""

from __future__ import annotations

import shutil
from pathlib import Path

import dvc_outputs
import pytest
from builders import stand_in_verifier
from fake_openai import fake_servers, reply
from generate_workspace import vllm_params

from eagle3_pipeline.core import atomic, readers
from eagle3_pipeline.stages import generate

FIRST = {f"q{i:02d}": f"question q{i:02d}" for i in range(8)}
# q05 removed, q03 changed, q08 and q09 added, q01 moved from train to val
GROWN = {k: v for k, v in FIRST.items() if k != "q05"} | {
    "q03": "question changed q03",
    "q08": "question q08",
    "q09": "question q09",
}
VAL = {"first": {"q06", "q07"}, "grown": {"q01", "q07", "q09"}}


def _answer(body: dict) -> tuple[int, dict]:
    """The same request, the same answer (vLLM with a per-request seed, batch-invariant)."""
    said = body["messages"][-1]["content"]
    text = f"an answer to {said} (seed {body['seed']})"
    return reply(None, text, "stop", token_ids=[len(text), body["seed"] % 1000, 2])


def _workspace(root: Path, prompts: dict[str, str], val: set[str]) -> Path:
    """data/prepared/ holding `prompts` and a verifier folder; returns the verifier."""
    rows = {"train": [], "val": []}
    for rid, text in sorted(prompts.items()):
        rows["val" if rid in val else "train"].append(
            {"id": rid, "messages": [{"role": "user", "content": text}]}
        )
    for split, rs in rows.items():
        atomic.write_jsonl(root / f"data/prepared/{split}.jsonl", rs)
    verifier = root / "verifier"
    return verifier if verifier.is_dir() else stand_in_verifier(root)


def _published(root: Path) -> dict[str, bytes]:
    out = root / "data/generated"
    return {f.name: f.read_bytes() for f in sorted(out.iterdir())}


@pytest.mark.parametrize("teammate", ["workspace", "dvc-cache"])
def test_grown_prompts_cost_only_their_own_requests(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys, teammate: str
) -> None:
    run, scratch = tmp_path / "run", tmp_path / "scratch"
    with fake_servers() as start:
        server = start(_answer)
        monkeypatch.chdir(run.mkdir() or run)
        params = vllm_params(_workspace(run, FIRST, VAL["first"]), server_url=server.url)
        generate.run(params)
        assert sorted(server.requested_ids()) == sorted(FIRST)
        if teammate == "dvc-cache":  # pulled: in the cache and dvc.lock, deleted by `dvc repro`
            dvc_outputs.commit(run, "generate", ["data/generated"])
            dvc_outputs.pulled_only(run, ["data/generated"])
        else:  # the published output alone: no scratch journal
            shutil.rmtree(run / "data/.work")

        _workspace(run, GROWN, VAL["grown"])
        server.bodies.clear()
        capsys.readouterr()
        generate.run(params)
        assert sorted(server.requested_ids()) == ["q03", "q08", "q09"]  # (a) only those
        log = capsys.readouterr().out
        where = "data/generated" + (" as dvc.lock records it" if teammate == "dvc-cache" else "")
        assert f"[generate] reused 6 of 9 rows from {where}" in log and "; making 3" in log

        monkeypatch.chdir(scratch.mkdir() or scratch)
        fresh = vllm_params(_workspace(scratch, GROWN, VAL["grown"]), server_url=server.url)
        server.bodies.clear()
        generate.run(fresh)
        assert len(server.bodies) == 9
    rows = {s: readers.read_jsonl(run / f"data/generated/{s}.jsonl") for s in ("train", "val")}
    ids = sorted(r["id"] for rs in rows.values() for r in rs)
    assert ids == sorted(GROWN) and "q05" not in ids  # (b) the removed row is gone
    assert [r["id"] for r in rows["val"]] == ["q01", "q07", "q09"]  # q01 moved, not remade
    changed = next(r for r in rows["train"] if r["id"] == "q03")
    assert changed["content"].startswith("an answer to question changed q03")
    for split in ("train", "val"):  # (c) row for row, then byte for byte
        assert rows[split] == readers.read_jsonl(scratch / f"data/generated/{split}.jsonl")
    assert _published(run) == _published(scratch)


def test_a_new_turn_of_a_conversation_is_the_only_request(tmp_path: Path, monkeypatch) -> None:
    """turns: every: a user turn appended to a conversation asks that turn alone; the earlier
    turns' rows (and so the new turn's context) are the ones made before."""
    monkeypatch.chdir(tmp_path)
    conv = [{"role": "user", "content": "u1"}, {"role": "assistant", "content": "a1"}]
    conv += [{"role": "user", "content": "u2"}]
    verifier = _workspace(tmp_path, {}, set())
    atomic.write_jsonl(tmp_path / "data/prepared/train.jsonl", [{"id": "c", "messages": conv}])
    with fake_servers() as start:
        server = start(_answer)
        params = vllm_params(verifier, server_url=server.url, turns="every", concurrency=1)
        generate.run(params)
        assert len(server.bodies) == 2
        shutil.rmtree(tmp_path / "data/.work")
        longer = [*conv, {"role": "assistant", "content": "a2"}, {"role": "user", "content": "u3"}]
        atomic.write_jsonl(
            tmp_path / "data/prepared/train.jsonl", [{"id": "c", "messages": longer}]
        )
        server.bodies.clear()
        generate.run(params)
    assert [[m["content"] for m in b["messages"]][-1] for b in server.bodies] == ["u3"]
    rows = readers.read_jsonl(tmp_path / "data/generated/train.jsonl")
    assert [r["id"] for r in rows] == ["c.turn1", "c.turn2", "c.turn3"]
