"""Stage `train`: the EAGLE-3 drafter, trained by speculators' own trainer on the store.

Checkpoints live in data/.work/train/ (not a DVC output: DVC would copy them before each rerun);
a rerun after a kill resumes from the last complete epoch there. The stage's outputs are copies
of the best (lowest val loss) and final checkpoints. Metrics go to DVCLive (metrics/train/) and,
as plain lines, to stdout so a log file shows the loss.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from eagle3_pipeline import atomic, resume, store
from eagle3_pipeline import speculators_compat as sc
from eagle3_pipeline import verifier as vf
from eagle3_pipeline.errors import ParamsError, StoreError
from eagle3_pipeline.layers import resolve_layer_ids
from eagle3_pipeline.params import Params
from eagle3_pipeline.progress import log

STAGE = "train"
STORE_DIR = Path("data/hidden_states")
TOKENIZED_DIR = Path("data/tokenized")
VOCAB_DIR = Path("data/vocab")
OUTPUT_DIR = Path("models/trained")
LIVE_DIR = Path("metrics/train")
CHECKPOINT_FILES = ("config.json", "model.safetensors")


class MetricsSink:
    """speculators' metric dicts -> DVCLive series + a plain progress line every N steps."""

    def __init__(self, live, ttt_steps: int, log_every_steps: int) -> None:
        self.live = live
        self.ttt_steps = ttt_steps
        self.log_every = log_every_steps

    def __call__(self, record: dict[str, Any], step: int) -> None:
        self.live.step = step
        if "train" in record:
            m = record["train"]
            for key, value in m.items():
                if key != "error_records":
                    self.live.log_metric(f"train/{key}", float(value), plot=True)
            if "lr" in record:
                self.live.log_metric("train/lr", float(record["lr"]))
            tps = record.get("profile", {}).get("tokens_per_s")
            if tps is not None:
                self.live.log_metric("train/tokens_per_s", float(tps))
            if step % self.log_every == 0:
                accs = " ".join(
                    f"acc{k} {m.get(f'full_acc_{k}', math.nan):.3f}" for k in range(self.ttt_steps)
                )
                log(
                    STAGE,
                    f"epoch {record.get('epoch')} step {step} loss {m['loss']:.4f} "
                    f"{accs} lr {record.get('lr', math.nan):.2e}",
                )
        if "val" in record:
            v = {k.removesuffix("_epoch"): float(x) for k, x in record["val"].items()}
            v["acceptance_length"] = simulated_tau(v, self.ttt_steps)
            for key, value in v.items():
                if key != "error_records":
                    self.live.log_metric(f"val/{key}", value)
            log(
                STAGE,
                f"epoch {record.get('epoch')} val loss {v['loss']:.4f} "
                f"simulated acceptance length {v['acceptance_length']:.3f}",
            )
        self.live.next_step()


def simulated_tau(val: dict[str, float], ttt_steps: int) -> float:
    """1 + sum over positions of P(all drafts up to k right), from the chained cond accuracy."""
    tau, prefix = 1.0, 1.0
    for k in range(ttt_steps):
        prefix *= val.get(f"cond_acc_{k}", 0.0)
        tau += prefix
    return tau


def _samples(manifest: dict) -> tuple[list[sc.TrainingSample], int]:
    rows = {
        split: atomic.read_jsonl(TOKENIZED_DIR / f"{split}.jsonl") for split in ("train", "val")
    }
    samples: list[sc.TrainingSample] = []
    for split in ("train", "val"):  # speculators validates on the LAST rows
        for r in rows[split]:
            entry = manifest["samples"].get(r["id"])
            if entry is None:
                raise StoreError(f"{STORE_DIR}: sample {r['id']} missing: rerun extract")
            samples.append(
                {
                    "input_ids": r["input_ids"],
                    "loss_mask": r["loss_mask"],
                    "hidden_states_file": STORE_DIR / entry["file"],
                }
            )
    return samples, len(rows["train"])


def _copy_checkpoint(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True)
    for name in CHECKPOINT_FILES:
        shutil.copy2(src / name, dst / name)


def run(params: Params) -> None:
    from dvclive import Live

    t = params.train
    if t.init_from:
        raise ParamsError(
            f"params.yaml: train.init_from={t.init_from}: initialising from a published drafter "
            "is not supported yet; remove train.init_from to train from scratch"
        )
    n_layers, _, _ = vf.shape(vf.read_config(params.verifier.path))
    aux, final = resolve_layer_ids(params.layers, n_layers)
    manifest = store.read_manifest(STORE_DIR)
    store.check_layout(manifest, aux, final, STORE_DIR)
    samples, n_train = _samples(manifest)
    draft_vocab = params.vocab.draft_vocab_size
    key = resume.fingerprint(
        t.model_dump(exclude={"log_every_steps", "num_workers"}),
        aux,
        draft_vocab,
        resume.file_sha256(STORE_DIR / store.MANIFEST),
        resume.file_sha256(VOCAB_DIR / "d2t.npy"),
        resume.file_sha256(TOKENIZED_DIR / "train.jsonl"),
    )
    work = resume.scratch_dir(STAGE, key)
    data_dir, save_dir = work / "data", work / "checkpoints"
    sc.write_training_data(data_dir, samples)
    if not sys.stdout.isatty():
        os.environ.setdefault("TQDM_DISABLE", "1")  # bars are noise in a log file
    log(
        STAGE,
        f"{n_train} train + {len(samples) - n_train} val samples, aux {aux} + {final}, "
        f"draft vocab {draft_vocab}, {t.epochs} epochs, checkpoints in {save_dir}",
    )
    # DVCLive history lives beside the checkpoints, so a resumed run keeps the earlier curves.
    live_dir = work / "live"
    with Live(
        dir=str(live_dir), save_dvc_exp=False, dvcyaml=None, report=None, resume=save_dir.exists()
    ) as live:
        live.log_params(
            {"train": t.model_dump(), "aux_layer_ids": aux, "draft_vocab_size": draft_vocab}
        )
        sink = MetricsSink(live, t.ttt_steps, t.log_every_steps)
        sc.run_training(
            data_dir=data_dir,
            verifier_dir=Path(params.verifier.path),
            save_dir=save_dir,
            d2t_path=VOCAB_DIR / "d2t.npy",
            t2d_path=VOCAB_DIR / "t2d.npy",
            draft_vocab_size=draft_vocab,
            target_layer_ids=aux,
            epochs=t.epochs,
            lr=t.lr,
            scheduler=t.scheduler,
            warmup_ratio=t.warmup_ratio,
            noise_std=t.noise_std,
            ttt_steps=t.ttt_steps,
            ttt_step_loss_decay=t.ttt_step_loss_decay,
            total_seq_len=t.max_tokens_per_batch,
            seed=t.seed,
            num_workers=t.num_workers,
            train_data_ratio=sc.train_data_ratio_for(n_train, len(samples)),
            on_metrics=sink,
            log_every_steps=1,
            train_lm_head=t.train_lm_head,
        )
    summary = json.loads((live_dir / "metrics.json").read_text())
    shutil.rmtree(LIVE_DIR, ignore_errors=True)
    shutil.copytree(live_dir, LIVE_DIR)
    best = sc.best_checkpoint(save_dir)
    with atomic.replace_dir(OUTPUT_DIR) as tmp:
        _copy_checkpoint(best, tmp / "best")
        _copy_checkpoint(save_dir / str(t.epochs - 1), tmp / "final")
        atomic.write_json(tmp / "summary.json", {"best_epoch": int(best.name), "epochs": t.epochs})
    atomic.write_json(
        Path("metrics/train.json"),
        {
            "best_epoch": int(best.name),
            "val_at_last_epoch": {k: round(v, 6) for k, v in summary.get("val", {}).items()},
        },
    )
    log(STAGE, f"best epoch {best.name} -> {OUTPUT_DIR}/best, final -> {OUTPUT_DIR}/final")
