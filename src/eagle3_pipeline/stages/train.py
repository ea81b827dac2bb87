"""Stage `train`: the EAGLE-3 drafter, trained by speculators' own trainer on the store.

Checkpoints live in data/.work/train/ (not a DVC output: DVC would copy them before each rerun);
a rerun after a kill (SIGKILL included) resumes from the last complete epoch there, exactly
(speculators_compat: weights, optimizer, scheduler, RNG; the data order is a function of seed
and epoch), and cuts the DVCLive series back to it. `train.keep_last` bounds the epochs kept.
The stage's outputs are copies of the best (lowest val loss) and final checkpoints. Metrics go
to DVCLive (metrics/train/) and, as plain lines, to stdout so a log file shows the loss.

`train.nproc` > 1 relaunches the training part through torchrun (`python -m
eagle3_pipeline.stages.train --worker PARAMS_JSON` per process); this process prepares the
data, forwards SIGINT/SIGTERM to torchrun and copies the outputs; rank 0 alone logs.
"""

from __future__ import annotations

import contextlib
import csv
import json
import math
import os
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3_pipeline import atomic, paths, resume
from eagle3_pipeline import verifier as vf
from eagle3_pipeline.errors import ParamsError, StoreError
from eagle3_pipeline.layer_ids import resolve_layer_ids
from eagle3_pipeline.params import Params
from eagle3_pipeline.progress import log
from eagle3_pipeline.store import format as store
from eagle3_pipeline.training import speculators_compat as sc

STAGE = "train"
STORE_DIR = paths.HIDDEN_STATES
TOKENIZED_DIR = paths.TOKENIZED
VOCAB_DIR = paths.VOCAB
OUTPUT_DIR = paths.TRAINED
LIVE_DIR = paths.TRAIN_LIVE
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
            if "grad_norm" in record:
                self.live.log_metric("train/grad_norm", float(record["grad_norm"]))
            tps = (record.get("profile") or {}).get("tokens_per_s")
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
            # Once per epoch, not per step: Live.next_step() also re-parses every series for
            # DVC Studio (even with Studio off), 30-50 ms a step here and growing with the run.
            # A kill can leave metrics.json stale; a resumed run rebuilds it (_trim_live).
            self.live.make_summary()


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


@dataclass(frozen=True)
class _Plan:
    """What every process of one run derives the same way from params and the inputs."""

    aux: list[int]
    final: int
    samples: list[sc.TrainingSample]
    n_train: int
    work: Path

    @property
    def data_dir(self) -> Path:
        return self.work / "data"

    @property
    def save_dir(self) -> Path:
        return self.work / "checkpoints"

    @property
    def live_dir(self) -> Path:
        # DVCLive history lives beside the checkpoints, so a resumed run keeps earlier curves.
        return self.work / "live"


def _plan(params: Params) -> _Plan:
    t = params.train
    n_layers, _, _ = vf.shape(vf.read_config(params.verifier.path))
    aux, final = resolve_layer_ids(params.layers, n_layers)
    manifest = store.read_manifest(STORE_DIR)
    store.check_layout(manifest, aux, final, STORE_DIR)
    # Never train on a damaged file: DVC's hardlinked cache would not notice one changed in place.
    store.verify_hashes(STORE_DIR, manifest)
    samples, n_train = _samples(manifest)
    key = resume.fingerprint(
        # Knobs that cannot change the weights do not restart a run.
        t.model_dump(exclude={"log_every_steps", "num_workers", "keep_last"}),
        aux,
        params.vocab.draft_vocab_size,
        resume.file_sha256(STORE_DIR / store.MANIFEST),
        resume.file_sha256(VOCAB_DIR / "d2t.npy"),
        resume.file_sha256(TOKENIZED_DIR / "train.jsonl"),
        # Other weights at the same path start over (stamp: names, sizes, mtimes; no hashing).
        vf.files_stamp(t.init_from) if t.init_from and Path(t.init_from).is_dir() else None,
    )
    return _Plan(aux, final, samples, n_train, resume.scratch_dir(STAGE, key))


def _trim_live(live_dir: Path, save_dir: Path) -> bool:
    """Cut the DVCLive series back to the last complete epoch; False: start them afresh.

    A killed run logged steps after that epoch; the rerun logs them again. Validation of an
    epoch is logged at the step the next epoch starts with, so val rows at that step stay.
    metrics.json (which a kill can leave torn: DVCLive writes it in place) is rebuilt from the
    kept rows, since DVCLive reads its step from there when it resumes.
    """
    complete = sc.complete_epochs(save_dir)
    if not complete or not live_dir.is_dir():
        shutil.rmtree(live_dir, ignore_errors=True)
        return False
    marker = json.loads((save_dir / str(complete[-1]) / sc.COMPLETE_MARKER).read_text())
    resume_step = int(marker["global_step"])
    series_root = live_dir / "plots" / "metrics"
    summary: dict[str, Any] = {"step": 0}
    for tsv in sorted(series_root.glob("**/*.tsv")):
        is_val = tsv.parent.name == "val"
        with open(tsv, newline="") as fh:
            rows = list(csv.DictReader(fh, delimiter="\t"))
        kept = [
            r
            for r in rows
            if int(r["step"]) < resume_step or (is_val and int(r["step"]) == resume_step)
        ]
        if not rows:
            continue
        columns = list(rows[0])
        atomic.write_text(
            tsv,
            "\t".join(columns)
            + "\n"
            + "".join("\t".join(r[c] for c in columns) + "\n" for r in kept),
        )
        if kept:
            node = summary
            for part in tsv.relative_to(series_root).parent.parts:
                node = node.setdefault(part, {})
            node[tsv.stem] = float(kept[-1][tsv.stem])
            summary["step"] = max(summary["step"], int(kept[-1]["step"]))
    atomic.write_json(live_dir / "metrics.json", summary)
    return True


def _train(params: Params, plan: _Plan) -> None:
    """The training of one process (the only one, or one torchrun worker)."""
    from dvclive import Live

    t = params.train
    rank = int(os.environ.get("RANK", "0"))
    kwargs: dict[str, Any] = {
        "data_dir": plan.data_dir,
        "verifier_dir": Path(params.verifier.path),
        "save_dir": plan.save_dir,
        "d2t_path": VOCAB_DIR / "d2t.npy",
        "t2d_path": VOCAB_DIR / "t2d.npy",
        "draft_vocab_size": params.vocab.draft_vocab_size,
        "target_layer_ids": plan.aux,
        "epochs": t.epochs,
        "lr": t.lr,
        "scheduler": t.scheduler,
        "warmup_ratio": t.warmup_ratio,
        "noise_std": t.noise_std,
        "ttt_steps": t.ttt_steps,
        "ttt_step_loss_decay": t.ttt_step_loss_decay,
        "total_seq_len": t.max_tokens_per_batch,
        "seed": t.seed,
        "num_workers": t.num_workers,
        "train_data_ratio": sc.train_data_ratio_for(plan.n_train, len(plan.samples)),
        "log_every_steps": 1,
        "train_lm_head": t.train_lm_head,
        "keep_last": t.keep_last,
        "grad_accumulation": t.grad_accumulation,
        "fsdp": t.strategy == "fsdp" and t.nproc > 1,
        "init_from": Path(t.init_from) if t.init_from else None,
        "init_vocab_mismatch": t.init_vocab_mismatch,
        "on_init_line": (lambda line: log(STAGE, line)) if rank == 0 else (lambda line: None),
    }
    if rank != 0:  # only rank 0 logs metrics and writes DVCLive
        sc.run_training(on_metrics=None, **kwargs)
        return
    with Live(
        dir=str(plan.live_dir),
        save_dvc_exp=False,
        dvcyaml=None,
        report=None,
        resume=plan.live_dir.is_dir(),
    ) as live:
        live.log_params(
            {
                "train": t.model_dump(),
                "aux_layer_ids": plan.aux,
                "draft_vocab_size": params.vocab.draft_vocab_size,
            }
        )
        sc.run_training(on_metrics=MetricsSink(live, t.ttt_steps, t.log_every_steps), **kwargs)


def _launch_torchrun(params: Params, plan: _Plan) -> None:
    """`torchrun` with one worker per process; signals reach the workers; failures raise."""
    spec = plan.work / "params.json"
    atomic.write_text(spec, params.model_dump_json())
    cmd = sc.torchrun_command(params.train.nproc, __name__, ["--worker", str(spec)])
    log(STAGE, f"launching {params.train.nproc} processes ({params.train.strategy}): torchrun")
    proc = subprocess.Popen(cmd, preexec_fn=_die_with_parent)
    signalled: list[int] = []

    def forward(signum: int, _frame: Any) -> None:
        signalled.append(signum)
        proc.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        rc = proc.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if signalled or rc in (-signal.SIGINT, -signal.SIGTERM, 130):
        raise sc.TrainingInterrupted(
            f"training stopped by a signal (torchrun exit {rc}); rerun to resume from the "
            "last complete epoch"
        )
    if rc != 0:
        raise RuntimeError(f"torchrun exited with {rc}: see the workers' output above")


def _die_with_parent() -> None:
    """In the torchrun child: SIGTERM when this process dies, SIGKILL included (Linux).

    torchrun forwards it to the workers, so no orphan keeps training beside a rerun.
    """
    import ctypes

    with contextlib.suppress(OSError, AttributeError):  # not glibc: no parent-death signal
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def run(params: Params) -> None:
    t = params.train
    if t.strategy == "fsdp" and t.nproc == 1:
        raise ParamsError(
            "params.yaml: train.strategy=fsdp shards the drafter across processes but "
            "train.nproc=1: set train.nproc to the number of GPUs, or strategy: ddp"
        )
    plan = _plan(params)
    sc.write_training_data(plan.data_dir, plan.samples)
    if not sys.stdout.isatty():
        os.environ.setdefault("TQDM_DISABLE", "1")  # bars are noise in a log file
    removed = sc.discard_incomplete(plan.save_dir)
    done = sc.complete_epochs(plan.save_dir)
    log(
        STAGE,
        f"{plan.n_train} train + {len(plan.samples) - plan.n_train} val samples, aux "
        f"{plan.aux} + {plan.final}, draft vocab {params.vocab.draft_vocab_size}, {t.epochs} "
        f"epochs, checkpoints in {plan.save_dir}"
        + (f"; resuming after epoch {done[-1]}" if done else "")
        + (f" (discarded incomplete: {', '.join(removed)})" if removed else ""),
    )
    _trim_live(plan.live_dir, plan.save_dir)
    if t.nproc > 1:
        _launch_torchrun(params, plan)
    else:
        _train(params, plan)
    _finish(params, plan)


def _finish(params: Params, plan: _Plan) -> None:
    t = params.train
    summary = json.loads((plan.live_dir / "metrics.json").read_text())
    shutil.rmtree(LIVE_DIR, ignore_errors=True)
    shutil.copytree(plan.live_dir, LIVE_DIR)
    best = sc.best_checkpoint(plan.save_dir)
    with atomic.replace_dir(OUTPUT_DIR) as tmp:
        _copy_checkpoint(best, tmp / "best")
        _copy_checkpoint(plan.save_dir / str(t.epochs - 1), tmp / "final")
        atomic.write_json(tmp / "summary.json", {"best_epoch": int(best.name), "epochs": t.epochs})
    atomic.write_json(
        paths.TRAIN_METRICS,
        {
            "best_epoch": int(best.name),
            "val_at_last_epoch": {k: round(v, 6) for k, v in summary.get("val", {}).items()},
        },
    )
    log(STAGE, f"best epoch {best.name} -> {OUTPUT_DIR}/best, final -> {OUTPUT_DIR}/final")


def _worker_main(argv: list[str]) -> int:
    """One torchrun worker: `python -m eagle3_pipeline.stages.train --worker PARAMS_JSON`."""
    if len(argv) != 2 or argv[0] != "--worker":
        print("usage: python -m eagle3_pipeline.stages.train --worker PARAMS_JSON", file=sys.stderr)
        return 2
    params = Params.model_validate_json(Path(argv[1]).read_text())
    if not sys.stdout.isatty():
        os.environ.setdefault("TQDM_DISABLE", "1")
    try:
        _train(params, _plan(params))
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(_worker_main(sys.argv[1:]))
