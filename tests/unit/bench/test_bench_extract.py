"""bench/bench_extract.py: the pieces that decide what it compares (which samples)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "bench"))

import bench_extract  # noqa: E402


def test_extract_samples_are_the_first_of_train_then_val(tmp_path: Path) -> None:
    for split, ids in (("train", ["t1", "t2"]), ("val", ["v1", "v2"])):
        (tmp_path / f"{split}.jsonl").write_text(
            "".join(json.dumps({"id": i, "input_ids": [1, 2], "split": split}) + "\n" for i in ids)
        )
    assert list(bench_extract.first_samples(tmp_path, 3)) == ["t1", "t2", "v1"]
    assert list(bench_extract.first_samples(tmp_path, None)) == ["t1", "t2", "v1", "v2"]


def test_help_needs_no_vllm(capsys) -> None:
    had_vllm = "vllm" in sys.modules
    with pytest.raises(SystemExit) as exit_:
        bench_extract.main(["--help"])
    assert exit_.value.code == 0
    assert "Benchmark" in capsys.readouterr().out
    assert had_vllm or "vllm" not in sys.modules
