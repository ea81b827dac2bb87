"""Benchmark of `eagle3 prepare` at the size drafters are trained on (issue: "0 of 4 prepare").

Builds prompt sets in a temp dir, shaped as the public datasets are downloaded: UltraChat-like
parquet shards (`prompt_id`, multi-turn `messages`) and the same rows as JSON lines, and a
ShareGPT-like JSON array without ids (ids derived from content); 1% of rows are unusable (empty).
Runs `eagle3 prepare` on each (`trailing_assistant: regenerate`) in a fresh subprocess and reports
its peak RSS (VmHWM of that process; and its RSS after imports) and rows/s, at 20k and 200k rows:
a bounded prepare's peak hardly grows with the set. Prints a table and writes
bench/results/prepare.json.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench/results/prepare.json"
SIZES = (20_000, 200_000)
SHARDS = 4
ANSWER = "Sure. " + "This is a fairly ordinary answer sentence of moderate length. " * 8

# Runs the stage as `eagle3 prepare` does, less the CLI's provenance record (which imports torch
# after the stage, ~200 MB that are not prepare's), and prints its RSS after imports and its peak
# (VmHWM: ru_maxrss would carry the bench's own peak across fork and exec).
CHILD = """
import re
from eagle3_pipeline.config.params import load_params
from eagle3_pipeline.stages import prepare
def kb(field):
    return re.search(field + r":\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)
print("RSS_BEFORE_KB", kb("VmRSS"), flush=True)
prepare.run(load_params("params.yaml"))
print("PEAK_RSS_KB", kb("VmHWM"), flush=True)
"""


def _rows(n: int) -> list[dict]:
    rows = []
    for i in range(n):
        if i % 100 == 99:
            rows.append({"prompt": "", "prompt_id": f"{i:064x}", "messages": []})
            continue
        q = f"Question {i}: how would you explain topic {i % 997} to a student?"
        rows.append(
            {
                "prompt": q,
                "prompt_id": f"{i:064x}",
                "messages": [
                    {"role": "user", "content": q},
                    {"role": "assistant", "content": ANSWER},
                    {"role": "user", "content": f"And in one line, for case {i}?"},
                    {"role": "assistant", "content": ANSWER[:120]},
                ],
            }
        )
    return rows


def _write_sets(root: Path, n: int) -> dict[str, Path]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = _rows(n)
    sets = {k: root / f"{k}-{n}" for k in ("parquet", "jsonl", "json-array")}
    for d in sets.values():
        d.mkdir()
    per = -(-n // SHARDS)
    for k in range(SHARDS):
        chunk = rows[k * per : (k + 1) * per]
        name = f"train-{k:05d}-of-{SHARDS:05d}"
        pq.write_table(pa.Table.from_pylist(chunk), sets["parquet"] / f"{name}.parquet")
        with open(sets["jsonl"] / f"{name}.jsonl", "w") as fh:
            fh.writelines(json.dumps(r) + "\n" for r in chunk)
    share = [
        {
            "conversations": [
                {"from": "human" if m["role"] == "user" else "gpt", "value": m["content"]}
                for m in r["messages"]
            ]
        }
        for r in rows
    ]
    with open(sets["json-array"] / "sharegpt.json", "w") as fh:
        json.dump(share, fh, indent=1)
    del rows, share  # the child's memory is measured, not ours
    return sets


def _run(prompts: Path, work: Path) -> dict:
    work.mkdir()
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["prepare"] |= {"prompts": str(prompts), "trailing_assistant": "regenerate"}
    (work / "params.yaml").write_text(yaml.safe_dump(params))
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", CHILD], cwd=work, env=env, capture_output=True, text=True
    )
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"prepare failed on {prompts}: {proc.stderr.strip()}")
    rate = re.search(r"read (\d+) rows in ([\d.]+) s \((\d+) rows/s\)", proc.stdout)
    kept = re.search(r"kept (\d+), skipped (\d+)", proc.stdout)
    rss = re.search(r"PEAK_RSS_KB (\d+)", proc.stdout)
    before = re.search(r"RSS_BEFORE_KB (\d+)", proc.stdout)
    out = work / "data/prepared"
    return {
        "rows": int(rate.group(1)),
        "kept": int(kept.group(1)),
        "skipped": int(kept.group(2)),
        "read_and_write_s": float(rate.group(2)),
        "rows_per_s": int(rate.group(3)),
        "wall_s": round(wall, 2),
        "peak_rss_mb": round(int(rss.group(1)) / 1024, 1),
        "rss_after_imports_mb": round(int(before.group(1)) / 1024, 1),
        "input_mb": round(sum(f.stat().st_size for f in prompts.iterdir()) / 2**20, 1),
        "output_mb": round(sum(f.stat().st_size for f in out.iterdir()) / 2**20, 1),
    }


def main() -> None:
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-prepare-") as tmp:
        root = Path(tmp)
        for n in SIZES:
            for fmt, prompts in _write_sets(root, n).items():
                r = {"format": fmt, **_run(prompts, root / f"work-{fmt}-{n}")}
                results.append(r)
                print(
                    f"{fmt:>10} {r['rows']:>7} rows ({r['input_mb']:>6.1f} MB): "
                    f"{r['rows_per_s']:>6} rows/s, peak RSS {r['peak_rss_mb']:>6.1f} MB "
                    f"({r['rss_after_imports_mb']:.0f} MB after imports), "
                    f"wall {r['wall_s']:>5.1f} s, kept {r['kept']}, skipped {r['skipped']}",
                    flush=True,
                )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"prepare": results}, indent=2) + "\n")
    print(f"wrote {RESULTS.relative_to(REPO)}")


if __name__ == "__main__":
    main()
