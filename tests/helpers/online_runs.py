"""Stand-ins for online evaluation's server runs: results without vLLM, and the stage's inputs."""

from __future__ import annotations

import json
from pathlib import Path

from eagle3_pipeline.evaluation.measure import RunResult


def fake_run(
    tokens: list[list[int]], wall: float, drafts: float, accepted: float, k: int = 3
) -> RunResult:
    """A run whose counters say `drafts` drafts of `k` tokens with `accepted` accepted."""
    counters = {"num_drafts": drafts, "num_draft_tokens": drafts * k}
    counters |= {"num_accepted_tokens": accepted}
    counters |= {f"accepted_pos_{p}": accepted / k for p in range(k)}
    counters |= {"spec_decode_enabled": float(drafts > 0)}
    return RunResult(tokens, [str(t) for t in tokens], [len(t) for t in tokens], wall, counters)


def stepped_run(
    tokens: list[list[int]], accepted: list[list[int]], wall: float = 1.0, k: int = 3
) -> RunResult:
    """A drafter's run with vLLM's per-answer step counts (`accepted` per verify step of each
    answer, k drafted each), its counters their sums, every answer cut at max_tokens."""
    steps = [a for answer in accepted for a in answer]
    run = fake_run(tokens, wall, drafts=len(steps), accepted=sum(steps), k=k)
    run.steps = [(list(a), [k] * len(a)) for a in accepted]
    run.finish_reasons = ["length"] * len(tokens)
    return run


def write_val_prompts(root: Path, n: int = 5) -> None:
    """data/prepared/val.jsonl with rows p0..p{n-1}."""
    rows = [{"id": f"p{i}", "messages": [{"role": "user", "content": f"q{i}"}]} for i in range(n)]
    path = root / "data/prepared/val.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
