"""Stage `train`: the EAGLE-3 drafter, trained by speculators' own trainer on the store.

`train.hidden_states: online` trains without a store: speculators asks a vLLM server of the
verifier for each row's hidden states while it trains (online_training.source; the server is started
here unless `train.online.endpoint` names one); the val rows extract stored are read from disk.

Checkpoints live in data/.work/train/ (not a DVC output: DVC would copy them before each rerun);
a rerun after a kill (SIGKILL included) resumes from the last complete epoch there, exactly
(training.checkpoints), and cuts the DVCLive series back to it. `train.keep_last` bounds the
epochs kept. The outputs are copies of the best (lowest val loss) and final checkpoints. Metrics
go to DVCLive (metrics/train/) and, as plain lines, to stdout so a log file shows the loss; the
metrics file also names the rows the processes' loaders held (`train_rows`, `train_ids_hash`).

`train.nproc` > 1 relaunches the training part through torchrun (`python -m
eagle3_pipeline.stages.train --worker RUN_JSON` per process: training/launch.py); this process
resolves the run once (rows, conventions, scratch folder, server: training/inputs.py
ResolvedRun), prepares the data, forwards SIGINT/SIGTERM to torchrun and copies the outputs; the
workers train the run as written, and rank 0 alone logs. With `cluster.engine: ray` the same
workers run under one torchrun agent per training node, and online mode there splits the
cluster: vLLM (and a Mooncake master) on an inference pool, torchrun on the training pool
(online_training/pools.py). The online server is checked against the store before step one
(online_training/checks.py). Once resolved, the run is one `TrainJob` (training/inputs.py):
every branch, the servers around it (online_training/served.py) and the publishing read the job,
not params.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Callable
from pathlib import Path

from eagle3_pipeline.config import families
from eagle3_pipeline.config.families import FamilyParams
from eagle3_pipeline.config.params import Params
from eagle3_pipeline.conversations import split
from eagle3_pipeline.core import disk, paths, readers, resume
from eagle3_pipeline.core.errors import ParamsError, StoreError
from eagle3_pipeline.core.progress import log
from eagle3_pipeline.drafter import mask_token
from eagle3_pipeline.drafter.conventions import run_conventions
from eagle3_pipeline.online_training import source as online
from eagle3_pipeline.online_training.served import Served, served
from eagle3_pipeline.store import format as store
from eagle3_pipeline.training.checkpoints import discard_incomplete, resume_epoch
from eagle3_pipeline.training.data import (
    TRAINED_ROWS,
    TrainingSample,
    train_data_ratio_for,
    trained_rows,
    write_training_data,
)
from eagle3_pipeline.training.inputs import (
    ResolvedRun,
    TrainInputs,
    TrainJob,
    distributed,
    nodes,
)
from eagle3_pipeline.training.launch import die_with_agent, launch
from eagle3_pipeline.training.metrics import MetricsSink, open_live, trim_live
from eagle3_pipeline.training.publish import Outputs, publish
from eagle3_pipeline.training.run import TrainSettings, run_training, untrained_val
from eagle3_pipeline.verifier import identity as vf

STAGE = "train"


def run(params: Params, outputs: Outputs | None = None, fraction: float | None = None) -> None:
    """Train and publish to `outputs` (None: the stage's; a `family@NAME` branch passes its own);
    `fraction`: on that nested fraction of the training rows only (a learning-curve point)."""
    outputs = outputs or Outputs()
    t = params.train
    if t.strategy == "fsdp" and not distributed(t, params.cluster):
        raise ParamsError(
            "params.yaml: train.strategy=fsdp shards the drafter across processes but "
            "train.nproc=1 on one node: set train.nproc to the number of GPUs, or strategy: ddp"
        )
    inputs = dataclasses.replace(
        _inputs(params, outputs.family_key, fraction), record_as=outputs.stage
    )
    write_training_data(inputs.data_dir, inputs.samples, ids=inputs.row_ids)
    (inputs.save_dir / TRAINED_ROWS).unlink(missing_ok=True)  # this run's ranks write it anew
    if not sys.stdout.isatty():
        os.environ.setdefault("TQDM_DISABLE", "1")  # bars are noise in a log file
    removed = discard_incomplete(inputs.save_dir)
    done = resume_epoch(inputs.save_dir)
    log(
        STAGE,
        f"{inputs.n_train} train + {len(inputs.samples) - inputs.n_train} val samples, aux "
        f"{inputs.aux} + {inputs.final}, draft vocab {params.vocab.draft_vocab_size}, "
        f"{t.epochs} epochs, checkpoints in {inputs.save_dir}"
        + (f"; resuming after epoch {done}" if done is not None else "")
        + (f" (discarded incomplete: {', '.join(removed)})" if removed else ""),
    )
    family = t.family.name + (
        f", mask token {inputs.mask[0]} ({inputs.mask[1]})" if inputs.mask else ""
    )
    log(STAGE, f"drafter {family}; wiring: {inputs.conventions.describe()}")
    trim_live(inputs.live_dir, inputs.save_dir)
    # The run, resolved once for every branch: nothing below reads params for it.
    job = TrainJob(run_settings(params, inputs), inputs, params.cluster, params.vllm)
    _train_job(job, outputs)


def _train_job(job: TrainJob, outputs: Outputs) -> None:
    """Train `job` (in this process, or torchrun's workers; from the store, or online from its
    servers) and publish to `outputs`."""
    inputs = job.inputs
    # A checkpoint write that fails: OS reason, mount. Online, the hidden states' servers are up
    # (and checked) around the training, whichever way it runs.
    with disk.guard(STAGE, inputs.save_dir), served(job) as serving:
        if serving.pools is not None or job.distributed:
            launch(job.cluster, job.resolved(serving.settings), inputs, __name__, serving.pools)
        else:
            _train(job, serving)
    # What the ranks' loaders held (training.data), not what params say they should have.
    trained = trained_rows(inputs.save_dir, job.world_size)
    log(STAGE, f"trained on {trained['train_rows']} rows ({trained['train_ids_hash'][:12]})")
    twin = None  # a branch is measured against its untrained twin (evaluate does train's)
    if outputs.twin and job.train.hidden_states == "store":
        twin = untrained_val(job.settings, inputs.work / "twin")
    publish(
        outputs, inputs.live_dir, inputs.save_dir, job.train.epochs, job.train.family, twin, trained
    )


def run_family(params: Params, name: str) -> None:
    """`family@NAME` (`eagle3 train --family NAME`): the `families` entry NAME, trained."""
    run(*family_branch(params, name))


def run_fraction(params: Params, fraction: float) -> None:
    """`curve_train@F` (`eagle3 train --fraction F`): train's drafter, trained as train trains
    it, on the training rows inside fraction F by the split hash (split.in_fraction); the same
    val rows. Its offline measurement is the curve stage's (`eagle3 curve --measure F`)."""
    if fraction not in params.curve.fractions:
        raise ParamsError(
            f"params.yaml: field 'curve.fractions': {fraction} is not one of "
            f"{params.curve.fractions}: add it, or train a listed fraction"
        )
    run(params, Outputs.of_fraction(fraction), fraction=fraction)


def family_branch(params: Params, name: str) -> tuple[Params, Outputs]:
    """The params and outputs of `family@NAME`: train's, with train.family = families[NAME]
    (an EAGLE-3 entry keeps train.init_from; the others train from scratch)."""
    entry = families.entry(params.families, name)
    init_from = params.train.init_from if entry.name == "eagle3" else None
    t = params.train.model_copy(update={"family": entry, "init_from": init_from})
    own = params.layers.family_aux_layer_ids.get(name)  # else train's, from the same store
    layers = params.layers.model_copy(update={"aux_layer_ids": own}) if own else params.layers
    return params.model_copy(update={"train": t, "layers": layers}), Outputs.of_family(name)


def _inputs(
    params: Params, family_key: str = "train.family", fraction: float | None = None
) -> TrainInputs:
    t = params.train
    verifier = vf.read_verifier(params.verifier)
    conventions = run_conventions(params.layers, t, verifier.num_layers)
    aux, final = conventions.aux_layer_ids, conventions.final_layer_id
    manifest = store.read_manifest(paths.HIDDEN_STATES)
    positions = store.check_layout(manifest, aux, final, paths.HIDDEN_STATES)
    # Never train on a damaged file: DVC's hardlinked cache would not notice one changed in place.
    store.verify_hashes(paths.HIDDEN_STATES, manifest)
    keep = None
    if fraction is not None:
        val_ratio = params.prepare.val_ratio

        def keep(sample_id: str) -> bool:
            return split.in_fraction(sample_id, fraction, val_ratio)

    samples, n_train, row_ids = _samples(manifest, online=t.hidden_states == "online", keep=keep)
    if n_train == 0:
        raise ParamsError(
            f"params.yaml: field 'curve.fractions': fraction {fraction} holds no training row: "
            "raise it, or make more data"
        )
    # Before any weights load; `family_key` names the family's params in an error line.
    mask = mask_token.for_run(t.family, verifier, [s["input_ids"] for s in samples], family_key)
    # Knobs that cannot change the weights do not restart a run; nor does EAGLE-3 being named.
    knobs = {"log_every_steps", "num_workers", "keep_last", "online"}
    key = resume.fingerprint(
        t.model_dump(exclude=knobs | ({"family"} if t.family == FamilyParams() else set())),
        aux,
        conventions.flags,
        conventions.layer_config,
        params.vocab.draft_vocab_size,
        resume.file_sha256(paths.HIDDEN_STATES / store.MANIFEST),
        resume.file_sha256(paths.VOCAB / "d2t.npy"),
        resume.file_sha256(paths.TOKENIZED / "train.jsonl"),
        # Other weights at the same path start over (stamp: names, sizes, mtimes; no hashing).
        resume.files_stamp(t.init_from) if t.init_from and Path(t.init_from).is_dir() else None,
        # Another world size is another run (a single node keeps its key).
        *([{"train_nodes": nodes(params.cluster)}] if nodes(params.cluster) > 1 else []),
        *([{"fraction": fraction}] if fraction is not None else []),
    )
    own = resume.fingerprint(t.family.model_dump())[:8]  # branches keep each other's scratch
    scratch = STAGE if t.family == FamilyParams() else f"{STAGE}-{t.family.name}-{own}"
    if fraction is not None:
        scratch += f"-f{fraction}"
    work = resume.scratch_dir(scratch, key)
    return TrainInputs(conventions, samples, n_train, work, row_ids, verifier, positions, mask)


def _samples(
    manifest: dict, *, online: bool = False, keep: Callable[[str], bool] | None = None
) -> tuple[list[TrainingSample], int, list[str]]:
    """(rows, train rows, their sample ids) in speculators' order (it validates on the LAST
    rows); online mode leaves rows the store lacks (all train rows, val rows beyond
    extract.online_keep_val) to the server. `keep`: which training rows to train on (all)."""
    rows = {
        part: readers.read_jsonl(paths.TOKENIZED / f"{part}.jsonl") for part in ("train", "val")
    }
    if keep is not None:
        rows["train"] = [r for r in rows["train"] if keep(r["id"])]
    samples: list[TrainingSample] = []
    for part in ("train", "val"):
        for r in rows[part]:
            entry = manifest["samples"].get(r["id"])
            if entry is None and not online:
                raise StoreError(f"{paths.HIDDEN_STATES}: sample {r['id']} missing: rerun extract")
            samples.append(
                {
                    "input_ids": r["input_ids"],
                    "loss_mask": r["loss_mask"],
                    "hidden_states_file": paths.HIDDEN_STATES / entry["file"] if entry else None,
                }
            )
    return samples, len(rows["train"]), [r["id"] for part in ("train", "val") for r in rows[part]]


def _train(job: TrainJob, serving: Served) -> None:
    """The training of the stage's only process (online mode: with its server's flags and key)."""
    own = dataclasses.replace(
        serving.settings, online_flags=serving.flags, online_api_key=online.trainer_key()
    )
    _train_resolved(job.resolved(own), serving.source)


def run_settings(params: Params, inputs: TrainInputs) -> TrainSettings:
    """The run's TrainSettings, every branch's (online mode adds its flags and key per process:
    `_train`, `_worker_main`)."""
    return TrainSettings.from_params(
        params.train,
        data_dir=inputs.data_dir,
        save_dir=inputs.save_dir,
        verifier_dir=Path(params.verifier.path),
        vocab_dir=paths.VOCAB,
        draft_vocab_size=params.vocab.draft_vocab_size,
        conventions=inputs.conventions,
        train_data_ratio=train_data_ratio_for(inputs.n_train, len(inputs.samples)),
        nodes=nodes(params.cluster),
        mask_token_id=inputs.mask[0] if inputs.mask else None,
        store_positions=inputs.positions,
        verifier_num_layers=inputs.final,
    )


def _train_resolved(run: ResolvedRun, source: online.OnlineSource | None = None) -> None:
    """Train `run` in this process (the only one, or one torchrun worker); a row the online
    server refused is named in one line."""
    try:
        _train_process(run.settings, run.live_dir)
    except RuntimeError as exc:
        refused = online.refusal(exc, run.row_ids, source) if source else None
        if refused is None:
            raise
        raise refused from None


def _train_process(settings: TrainSettings, live_dir: Path) -> None:
    t = settings.train
    if int(os.environ.get("RANK", "0")) != 0:  # only rank 0 logs metrics and writes DVCLive
        run_training(settings, on_metrics=None, on_init_line=lambda line: None)
        return
    with open_live(live_dir) as live:
        live.log_params(
            {
                "train": t.model_dump(),
                "aux_layer_ids": list(settings.target_layer_ids),
                "draft_vocab_size": settings.draft_vocab_size,
            }
        )
        run_training(
            settings,
            on_metrics=MetricsSink(live, t.ttt_steps, t.log_every_steps, STAGE),
            on_init_line=lambda line: log(STAGE, line),
        )


def _worker_main(argv: list[str]) -> int:
    """One torchrun worker: `python -m eagle3_pipeline.stages.train --worker RUN_JSON`: the run
    the driver resolved (its rows, a fraction's included, and the scratch folder it publishes
    from), trained as written; online, against this rank's server."""
    usage = "usage: python -m eagle3_pipeline.stages.train --worker RUN_JSON"
    parser = argparse.ArgumentParser(usage=usage, add_help=False)
    parser.add_argument("--worker", required=True)
    try:
        args = parser.parse_args(argv)
    except SystemExit:
        return 2
    die_with_agent()
    run = ResolvedRun.read(Path(args.worker))
    if not sys.stdout.isatty():
        os.environ.setdefault("TQDM_DISABLE", "1")
    t = run.settings.train
    source = None
    if t.hidden_states == "online" and t.online.endpoint:
        endpoint = online.endpoint_for_rank(t.online.endpoint)
        source = online.OnlineSource(endpoint, f"the vLLM server at {endpoint}")
        settings = dataclasses.replace(
            run.settings,
            online_flags=online.speculators_flags(t.online, endpoint),
            online_api_key=online.trainer_key(),
        )
        run = dataclasses.replace(run, settings=settings)
    try:
        _train_resolved(run, source)
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(_worker_main(sys.argv[1:]))
