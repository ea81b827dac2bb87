"""bench/bench_generate.py: the pieces that decide what it compares (which prompts, the order
vLLM's bench sees, the lines the stage is timed by)."""

from __future__ import annotations

import io
import json
import random
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "bench"))

import bench_generate  # noqa: E402

from eagle3_pipeline.core.progress import Progress  # noqa: E402


@pytest.mark.parametrize("n", [1, 2, 8, 129])
def test_vllm_shuffle_gives_back_the_stage_order(n: int) -> None:
    items = [f"p{i:04d}" for i in range(n)]
    data = bench_generate.shuffle_inverse(items, bench_generate.SEED)
    random.seed(bench_generate.SEED)  # what vLLM's ShareGPTDataset.load_data does
    random.shuffle(data)
    assert data == items


def test_stage_is_timed_by_its_ready_and_last_progress_lines() -> None:
    assert bench_generate.READY.match("[vllm] server ready in 14 s\n")
    out = io.StringIO()
    progress = Progress("generate", 8, stream=out)
    progress.advance(1)
    progress.advance(7)
    lines = out.getvalue().splitlines()
    done = [m for m in map(bench_generate.DONE.match, lines) if m and m.group(1) == m.group(2)]
    assert len(done) == 1 and lines[-1].startswith("[generate] 8/8 100% ")


def test_bench_token_counts_are_read_from_its_log() -> None:
    text = "Throughput: 4.3 requests/s\nTotal num prompt tokens:  328\n"
    text += "Total num output tokens:  256\n"
    assert bench_generate.parse_bench_log(text) == {"output_tokens": 256, "prompt_tokens": 328}


def test_prompts_are_the_first_single_user_turns(tmp_path: Path) -> None:
    rows = [
        {"id": "a", "messages": [{"role": "user", "content": "x"}]},
        {"id": "b", "messages": [{"role": "user", "content": "x"}, {"role": "assistant"}]},
        {"id": "c", "messages": [{"role": "system", "content": "s"}]},
        {"id": "d", "messages": [{"role": "user", "content": "y"}]},
    ]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert [r["id"] for r in bench_generate.select_prompts(path, 2)] == ["a", "d"]
    with pytest.raises(SystemExit):
        bench_generate.select_prompts(path, 3)


def test_help_needs_no_vllm(capsys) -> None:
    had_vllm = "vllm" in sys.modules
    with pytest.raises(SystemExit) as exit_:
        bench_generate.main(["--help"])
    assert exit_.value.code == 0
    assert "Benchmark" in capsys.readouterr().out
    assert had_vllm or "vllm" not in sys.modules
