"""Benchmark: training throughput of our `train` stage vs speculators' own trainer, same data.

Target (issue "Training you can trust"): our wrapper costs <= 5% of speculators' throughput.

Both sides train the same drafter on the same speculators data directory (written once from
this repo's store, data/ read only) with the same TrainConfig (`run.build_train_config`):

* direct: `speculators.train.cli.main(cfg)`, what `speculators train <flags>` runs, with only
  the CPU shims it cannot run without here (device "cpu", no accelerator sync, CPU autocast,
  gloo). The CLI as a subprocess would need the same patches, so it runs in-process;
* ours: `run.run_training` with everything the stage adds: metrics tap into
  DVCLive (a Live per run, a series per metric and step), plain log lines, the step control
  (grad-norm record), exact-resume state, completion markers, keep_last pruning.

lm_head stays frozen and noise off in both (speculators has neither option). Runs alternate
(direct, ours, direct, ours, ...) to spread the machine's load drift over both sides; the ratio
is of the median wall time (setup + training + checkpoints), tokens = train tokens x epochs.
Prints a table and writes bench/results/train.json.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
os.environ.setdefault("TQDM_DISABLE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from eagle3_pipeline.config.training_params import TrainParams  # noqa: E402
from eagle3_pipeline.core import atomic, readers  # noqa: E402
from eagle3_pipeline.store import format as store  # noqa: E402
from eagle3_pipeline.training.data import (  # noqa: E402
    TrainingSample,
    train_data_ratio_for,
    write_training_data,
)
from eagle3_pipeline.training.metrics import MetricsSink  # noqa: E402
from eagle3_pipeline.training.run import (  # noqa: E402
    TrainSettings,
    build_train_config,
    run_training,
)
from eagle3_pipeline.training.speculators_patches import apply_cpu_shims  # noqa: E402

RESULTS = REPO / "bench/results/train.json"
DATA = REPO / "data"
TARGET_OVERHEAD = 0.05


def _training_inputs(work: Path) -> tuple[Path, int, int, int]:
    """The speculators data dir for this repo's store; (dir, train rows, rows, train tokens)."""
    manifest = store.read_manifest(DATA / "hidden_states")
    samples: list[TrainingSample] = []
    n_train, tokens = 0, 0
    for split in ("train", "val"):
        for row in readers.read_jsonl(DATA / "tokenized" / f"{split}.jsonl"):
            entry = manifest["samples"][row["id"]]
            samples.append(
                {
                    "input_ids": row["input_ids"],
                    "loss_mask": row["loss_mask"],
                    "hidden_states_file": DATA / "hidden_states" / entry["file"],
                }
            )
            if split == "train":
                n_train += 1
                tokens += len(row["input_ids"])
    data_dir = work / "data"
    write_training_data(data_dir, samples)
    return data_dir, n_train, len(samples), tokens


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3, help="runs per side")
    args = parser.parse_args(argv)

    import yaml
    from dvclive import Live

    params = yaml.safe_load((REPO / "params.yaml").read_text())
    t = params["train"]
    aux = params["layers"]["aux_layer_ids"]
    work = Path(tempfile.mkdtemp(prefix="bench-train-"))
    try:
        data_dir, n_train, n_rows, train_tokens = _training_inputs(work)
        train = TrainParams(
            epochs=args.epochs,
            lr=t["lr"],
            scheduler=t["scheduler"],
            warmup_ratio=t["warmup_ratio"],
            noise_std=0.0,
            ttt_steps=t["ttt_steps"],
            ttt_step_loss_decay=t["ttt_step_loss_decay"],
            max_tokens_per_batch=t["max_tokens_per_batch"],
            seed=t["seed"],
            num_workers=t["num_workers"],
            train_lm_head=False,
            keep_last=2,
        )
        settings = TrainSettings(
            train=train,
            data_dir=data_dir,
            verifier_dir=DATA / "verifier",
            save_dir=work / "ckpt",  # replaced per run
            d2t_path=DATA / "vocab/d2t.npy",
            t2d_path=DATA / "vocab/t2d.npy",
            draft_vocab_size=params["vocab"]["draft_vocab_size"],
            target_layer_ids=aux,
            train_data_ratio=train_data_ratio_for(n_train, n_rows),
            metrics_every_steps=1,
        )
        apply_cpu_shims()
        from speculators.train.cli import main as speculators_main

        def direct(run: Path) -> None:
            speculators_main(build_train_config(replace(settings, save_dir=run / "ckpt")))

        def ours(run: Path) -> None:
            with Live(dir=str(run / "live"), save_dvc_exp=False, dvcyaml=None, report=None) as live:
                run_training(
                    replace(settings, save_dir=run / "ckpt"),
                    on_metrics=MetricsSink(
                        live, t["ttt_steps"], t.get("log_every_steps", 10), "train"
                    ),
                )

        times: dict[str, list[float]] = {"direct": [], "ours": []}
        for i in range(args.repeats):
            for name, fn in (("direct", direct), ("ours", ours)):
                run = work / f"{name}{i}"
                run.mkdir()
                t0 = time.monotonic()
                fn(run)
                times[name].append(time.monotonic() - t0)
                shutil.rmtree(run)
                logging.getLogger("speculators").handlers.clear()
                print(f"  {name} run {i}: {times[name][-1]:.1f} s", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    tokens = train_tokens * args.epochs
    med = {k: statistics.median(v) for k, v in times.items()}
    tps = {k: tokens / v for k, v in med.items()}
    overhead = med["ours"] / med["direct"] - 1
    result = {
        "tokens_per_run": tokens,
        "epochs": args.epochs,
        "runs_per_side": args.repeats,
        "wall_s": times,
        "tokens_per_s": tps,
        "ours_over_direct_time": med["ours"] / med["direct"],
        "overhead": overhead,
        "target_overhead": TARGET_OVERHEAD,
    }
    atomic.write_json(RESULTS, result)
    print(f"{'side':<8} {'median s':>9} {'tokens/s':>10}")
    for k in ("direct", "ours"):
        print(f"{k:<8} {med[k]:>9.1f} {tps[k]:>10.0f}")
    verdict = "OK" if overhead <= TARGET_OVERHEAD else "OVER TARGET"
    print(
        f"our train stage vs speculators' trainer: x{tps['ours'] / tps['direct']:.3f} "
        f"throughput ({overhead:+.1%} wall time; target <= {TARGET_OVERHEAD:.0%}): {verdict}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
