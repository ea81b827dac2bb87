"""The recipe, chosen by measurement: train's drafter on one learning-curve fraction under each
variant of params.yaml, measured offline on the same val samples as every curve point.

    python scripts/recipe_sweep.py --fraction 0.25 \\
        base  lr3e-4:train.lr=3e-4  vocab4k:vocab.draft_vocab_size=4096  ...

Run in a workspace whose pipeline has run up to `vocab` (a store, a vocab mapping). Each variant
is `NAME:key=value,key=value` over params.yaml (values parsed as YAML; `base` = no change); it
runs `eagle3 vocab` when the variant changes `vocab.*` (restored afterwards), then `eagle3 train
--fraction F` and `eagle3 curve --measure F` with a params file of its own, and records the
offline mean acceptance length, the val acceptance per epoch and the wall time. Results go to
bench/results/recipe.json as they come, keyed NAME@FRACTION (one already there is not rerun),
and print as a table; docs/training.md holds the measured table and the choice made from it.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "bench/results/recipe.json"


def parse_variant(text: str) -> tuple[str, dict[str, object]]:
    name, _, spec = text.partition(":")
    overrides = {}
    for item in filter(None, spec.split(",")):
        key, _, value = item.partition("=")
        overrides[key] = yaml.safe_load(value)
    return name, overrides


def with_overrides(base: dict, overrides: dict[str, object], fraction: float) -> dict:
    params = json.loads(json.dumps(base))
    for key, value in overrides.items():
        node = params
        *path, last = key.split(".")
        for part in path:
            node = node.setdefault(part, {})
        node[last] = value
    fractions = params.setdefault("curve", {}).setdefault("fractions", [])
    if fraction not in fractions:
        fractions.append(fraction)
    return params


def eagle3(*args: str) -> None:
    proc = subprocess.run(["eagle3", *args], cwd=REPO, text=True, capture_output=True)
    sys.stdout.write(proc.stdout[-2000:])
    if proc.returncode != 0:
        raise SystemExit(f"eagle3 {' '.join(args)} failed:\n{proc.stderr[-3000:]}")


def epoch_taus(fraction: float) -> list[float]:
    tsv = REPO / f"metrics/fractions/{fraction}/train/plots/metrics/val/acceptance_length.tsv"
    if not tsv.is_file():
        return []
    with open(tsv, newline="") as fh:
        return [round(float(r["acceptance_length"]), 4) for r in csv.DictReader(fh, delimiter="\t")]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--fraction", type=float, required=True)
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("variants", nargs="+", help="NAME:key=value,key=value (base: no change)")
    args = ap.parse_args()
    base = yaml.safe_load((REPO / args.params).read_text())
    saved = json.loads(OUT.read_text()) if OUT.is_file() else {}
    results = saved.setdefault("runs", {})
    for text in args.variants:
        variant, overrides = parse_variant(text)
        name = f"{variant}@{args.fraction}"
        if name in results:
            continue
        params = with_overrides(base, overrides, args.fraction)
        path = REPO / f"data/.work/recipe/{variant}-{args.fraction}.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(params, sort_keys=False))
        touches_vocab = any(k.startswith("vocab.") for k in overrides)
        t0 = time.monotonic()
        try:
            if touches_vocab:
                eagle3("vocab", "--params", str(path))
            eagle3("train", "--params", str(path), "--fraction", str(args.fraction))
            eagle3("curve", "--params", str(path), "--measure", str(args.fraction))
        finally:
            if touches_vocab:
                eagle3("vocab", "--params", args.params)
        record = json.loads(
            (REPO / f"metrics/fractions/{args.fraction}/eval.json").read_text()
        )
        results[name] = {
            "variant": variant,
            "overrides": overrides,
            "fraction": args.fraction,
            "train_tokens": record["train_tokens"],
            "tau": record["tau"],
            "val_tau_by_epoch": epoch_taus(args.fraction),
            "wall_s": round(time.monotonic() - t0, 1),
        }
        OUT.parent.mkdir(parents=True, exist_ok=True)
        OUT.write_text(json.dumps(saved, indent=2) + "\n")
        print(f"{name}: tau {record['tau']:.3f} in {results[name]['wall_s']:.0f} s", flush=True)
    print("| variant | fraction | train tokens | overrides | offline tau | val tau by epoch | s |")
    print("|---|---|---|---|---|---|---|")
    for name, r in results.items():
        overrides = ", ".join(f"{k}={v}" for k, v in r["overrides"].items()) or "-"
        epochs = " ".join(f"{t:.2f}" for t in r["val_tau_by_epoch"])
        print(
            f"| {name.split('@')[0]} | {r['fraction']} | {r['train_tokens']:,} | {overrides} | "
            f"{r['tau']:.3f} | {epochs} | {r['wall_s']:.0f} |"
        )
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TQDM_DISABLE", "1")
    sys.exit(main())
