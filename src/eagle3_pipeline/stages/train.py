"""Stage `train`: the EAGLE-3 drafter, trained by speculators' own trainer on the store.

`train.hidden_states: online` trains without a store: speculators asks a vLLM server of the
verifier for each row's hidden states while it trains (training.online; the server is started
here unless `train.online.endpoint` names one); the val rows extract stored are read from disk.

Checkpoints live in data/.work/train/ (not a DVC output: DVC would copy them before each rerun);
a rerun after a kill (SIGKILL included) resumes from the last complete epoch there, exactly
(training.checkpoints), and cuts the DVCLive series back to it. `train.keep_last` bounds the
epochs kept. The outputs are copies of the best (lowest val loss) and final checkpoints. Metrics
go to DVCLive (metrics/train/) and, as plain lines, to stdout so a log file shows the loss.

`train.nproc` > 1 relaunches the training part through torchrun (`python -m
eagle3_pipeline.stages.train --worker PARAMS_JSON` per process); this process prepares the
data, forwards SIGINT/SIGTERM to torchrun and copies the outputs; rank 0 alone logs. With
`cluster.engine: ray` the same workers run under one torchrun agent per training node
(cluster.torchrun: c10d rendezvous; a lost node relaunches from the last complete epoch), and
which node did what goes into the stage's provenance. Online mode there splits the cluster:
vLLM (and a Mooncake master) on an inference pool, torchrun on the training pool
(cluster/online.py).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from eagle3_pipeline import atomic, disk, paths, readers, resume, split
from eagle3_pipeline.cluster import online as cluster_online
from eagle3_pipeline.drafter import families, mask_token
from eagle3_pipeline.drafter.conventions import RunConventions, run_conventions
from eagle3_pipeline.drafter.families import FamilyParams
from eagle3_pipeline.errors import ParamsError, StoreError
from eagle3_pipeline.params import Params
from eagle3_pipeline.progress import log
from eagle3_pipeline.store import format as store
from eagle3_pipeline.training import online
from eagle3_pipeline.training.checkpoints import (
    discard_incomplete,
    resume_epoch,
)
from eagle3_pipeline.training.data import (
    TrainingSample,
    train_data_ratio_for,
    write_training_data,
)
from eagle3_pipeline.training.launch import launch_torchrun, torchrun_command
from eagle3_pipeline.training.metrics import MetricsSink, open_live, trim_live
from eagle3_pipeline.training.online_backend import mooncake_env
from eagle3_pipeline.training.publish import Outputs, publish
from eagle3_pipeline.training.run import (
    TrainSettings,
    build_train_config,
    run_training,
    untrained_val,
)
from eagle3_pipeline.verifier import identity as vf

STAGE = "train"


@dataclass(frozen=True)
class TrainInputs:
    """What every process of one run derives alike from params and the stage's inputs."""

    conventions: RunConventions
    samples: list[TrainingSample]
    n_train: int
    work: Path
    row_ids: list[str]  # sample id of each row, in the order speculators indexes them
    positions: list[int] | None = None  # the run's layers in the store's files (final last)
    mask: tuple[int, str] | None = None  # P-EAGLE/DFlash mask token id, and how it was chosen
    record_as: str = STAGE  # the stage name of cluster records: train, or family@NAME

    @property
    def aux(self) -> list[int]:
        return self.conventions.aux_layer_ids

    @property
    def final(self) -> int:
        return self.conventions.final_layer_id

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


def run(params: Params, outputs: Outputs | None = None, fraction: float | None = None) -> None:
    """Train and publish to `outputs` (None: the stage's; a `family@NAME` branch passes its own);
    `fraction`: on that nested fraction of the training rows only (a learning-curve point)."""
    outputs = outputs or Outputs()
    t = params.train
    if t.strategy == "fsdp" and not _distributed(params):
        raise ParamsError(
            "params.yaml: train.strategy=fsdp shards the drafter across processes but "
            "train.nproc=1 on one node: set train.nproc to the number of GPUs, or strategy: ddp"
        )
    inputs = dataclasses.replace(
        _inputs(params, outputs.family_key, fraction), record_as=outputs.stage
    )
    write_training_data(inputs.data_dir, inputs.samples)
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
    with disk.guard(STAGE, inputs.save_dir):  # a checkpoint write that fails: OS reason, mount
        if t.hidden_states == "online":
            _train_online(params, inputs)
        elif _distributed(params):
            _launch(params, inputs)
        else:
            _train(params, inputs)
    twin = None  # a branch is measured against its untrained twin (evaluate does train's)
    if outputs.twin and t.hidden_states == "store":
        twin = untrained_val(_settings(params, inputs, None), inputs.work / "twin")
    publish(outputs, inputs.live_dir, inputs.save_dir, t.epochs, t.family, twin)


def _train_online(params: Params, inputs: TrainInputs) -> None:
    """Train with a vLLM server's hidden states, after checking it against the store."""
    t = params.train
    online.check_layer_order(inputs.aux, inputs.final)
    layer_ids = [*inputs.aux, inputs.final]
    if cluster_online.uses_pools(params):
        # Across nodes: vLLM (and the Mooncake master) on the inference pool, torchrun on the
        # training pool (cluster/online.py).
        with cluster_online.inference_pool(params, layer_ids, inputs.work) as pools:
            flags = _check_and_log(params, inputs, pools.source, len(pools.sources))
            for other in pools.sources[1:]:  # every server, not only the one params name
                _check_server(params, inputs, other, flags)
            _launch(_served_by(params, pools.source, pools.master), inputs, pools)
        return
    os.environ.update(mooncake_env(t.online))  # torchrun workers inherit it
    with online.online_source(params, layer_ids, inputs.work) as source:
        os.environ.update(online.trainer_env(source))  # this process's trainer, or torchrun's
        flags = _check_and_log(params, inputs, source)
        if _distributed(params):
            # Workers read the server from params: the one started here, or the given one.
            _launch(_served_by(params, source), inputs)
        else:
            _train(params, inputs, flags, source)


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


def _check_and_log(
    params: Params, inputs: TrainInputs, source: online.OnlineSource, servers: int = 1
) -> dict:
    """Log the plan, check the server against the store; speculators' online flags."""
    t = params.train
    stored = sum(s["hidden_states_file"] is not None for s in inputs.samples)
    online.log_plan(t.online, source, len(inputs.samples), stored, servers)
    flags = online.speculators_flags(t.online, source.endpoint)
    _check_server(params, inputs, source, flags)
    return flags


def _served_by(params: Params, source: online.OnlineSource, master: str | None = None) -> Params:
    """Params whose train.online names this server (and Mooncake master): what workers read."""
    o = params.train.online
    update: dict = {"endpoint": source.endpoint}
    if master:
        update["mooncake"] = o.mooncake.model_copy(update={"master": master})
    train = params.train.model_copy(update={"online": o.model_copy(update=update)})
    return params.model_copy(update={"train": train})


def _check_server(
    params: Params, inputs: TrainInputs, source: online.OnlineSource, flags: dict
) -> None:
    """The server's hidden states of the first stored row equal the store's (or refuse)."""
    from hs_connectors.transfer import FP8Transfer

    row = next((i for i, s in enumerate(inputs.samples) if s["hidden_states_file"]), None)
    if row is None:
        log(STAGE, "no stored row to check the server against: skipped")
        return
    stored = FP8Transfer(inputs.data_dir / "hidden_states").get_cached(row)
    assert stored is not None  # write_training_data linked it
    stored["hidden_states"] = stored["hidden_states"][:, inputs.positions or slice(None)]
    args = argparse.Namespace(**build_train_config(_settings(params, inputs, flags)).flatten())
    worst = online.check_server(
        source,
        args,
        inputs.samples[row]["input_ids"],
        stored["hidden_states"],
        inputs.row_ids[row],
        params.verifier.path,
    )
    log(
        STAGE,
        f"server checked on sample {inputs.row_ids[row]}: largest difference from the store "
        f"{worst:.2%} of a layer's range (accepted {online.PROBE_TOLERANCE:.0%})",
    )


def _inputs(
    params: Params, family_key: str = "train.family", fraction: float | None = None
) -> TrainInputs:
    t = params.train
    n_layers, _, _ = vf.shape(vf.read_config(params.verifier.path))
    conventions = run_conventions(params, n_layers)
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
    mask = mask_token.for_run(params, [s["input_ids"] for s in samples], family_key)
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
        vf.files_stamp(t.init_from) if t.init_from and Path(t.init_from).is_dir() else None,
        # Another world size is another run (a single node keeps its key).
        *([{"train_nodes": _nodes(params)}] if _nodes(params) > 1 else []),
        *([{"fraction": fraction}] if fraction is not None else []),
    )
    own = resume.fingerprint(t.family.model_dump())[:8]  # branches keep each other's scratch
    scratch = STAGE if t.family == FamilyParams() else f"{STAGE}-{t.family.name}-{own}"
    if fraction is not None:
        scratch += f"-f{fraction}"
    work = resume.scratch_dir(scratch, key)
    return TrainInputs(conventions, samples, n_train, work, row_ids, positions, mask)


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


def _settings(params: Params, inputs: TrainInputs, online_flags: dict | None) -> TrainSettings:
    settings = TrainSettings.from_params(
        params.train,
        data_dir=inputs.data_dir,
        save_dir=inputs.save_dir,
        verifier_dir=Path(params.verifier.path),
        vocab_dir=paths.VOCAB,
        draft_vocab_size=params.vocab.draft_vocab_size,
        conventions=inputs.conventions,
        train_data_ratio=train_data_ratio_for(inputs.n_train, len(inputs.samples)),
        nodes=_nodes(params),
        mask_token_id=inputs.mask[0] if inputs.mask else None,
        store_positions=inputs.positions,
        verifier_num_layers=inputs.final,
    )
    return dataclasses.replace(settings, online_flags=online_flags)


def _train(
    params: Params,
    inputs: TrainInputs,
    online_flags: dict | None = None,
    source: online.OnlineSource | None = None,
) -> None:
    """The training of one process (the only one, or one torchrun worker)."""
    try:
        _train_process(params, inputs, _settings(params, inputs, online_flags))
    except RuntimeError as exc:
        refused = online.refusal(exc, inputs.row_ids, source) if source else None
        if refused is None:
            raise
        raise refused from None


def _train_process(params: Params, inputs: TrainInputs, settings: TrainSettings) -> None:
    t = params.train
    if int(os.environ.get("RANK", "0")) != 0:  # only rank 0 logs metrics and writes DVCLive
        run_training(settings, on_metrics=None, on_init_line=lambda line: None)
        return
    with open_live(inputs.live_dir) as live:
        live.log_params(
            {
                "train": t.model_dump(),
                "aux_layer_ids": inputs.aux,
                "draft_vocab_size": params.vocab.draft_vocab_size,
            }
        )
        run_training(
            settings,
            on_metrics=MetricsSink(live, t.ttt_steps, t.log_every_steps, STAGE),
            on_init_line=lambda line: log(STAGE, line),
        )


def _nodes(params: Params) -> int:
    """Training nodes: cluster.training_nodes on a Ray cluster, else this machine alone."""
    return params.cluster.training_nodes if params.cluster.engine == "ray" else 1


def _distributed(params: Params) -> bool:
    """More than one training process: launched through torchrun."""
    return params.train.nproc > 1 or _nodes(params) > 1


def _launch(params: Params, inputs: TrainInputs, pools: cluster_online.Pools | None = None) -> None:
    """One `_worker_main` per process under torchrun, from the params written to scratch."""
    spec = inputs.work / "params.json"
    atomic.write_text(spec, params.model_dump_json())
    worker = ["--worker", str(spec.resolve())]
    if params.cluster.engine == "ray":
        _launch_on_cluster(params, inputs, worker, pools)
        return
    cmd = torchrun_command(params.train.nproc, __name__, worker)
    log(STAGE, f"launching {params.train.nproc} processes ({params.train.strategy}): torchrun")
    launch_torchrun(cmd)


def _launch_on_cluster(
    params: Params, inputs: TrainInputs, worker: list[str], pools: cluster_online.Pools | None
) -> None:
    """One torchrun agent per training node (cluster.torchrun), on the training pool when
    online training has one; record who did what."""
    from eagle3_pipeline.cluster import engine, preflight, record, torchrun

    c = params.cluster
    engine.connect(c)

    def before_attempt(number: int) -> None:
        if number == 1:  # run() tidied the scratch dir already
            return
        removed = discard_incomplete(inputs.save_dir)
        trim_live(inputs.live_dir, inputs.save_dir)
        done = resume_epoch(inputs.save_dir)
        log(
            STAGE,
            f"cluster: attempt {number} "
            + (f"resumes after epoch {done}" if done is not None else "starts afresh")
            + (f" (discarded incomplete: {', '.join(removed)})" if removed else ""),
        )

    log(
        STAGE,
        f"launching {_nodes(params)} nodes x {params.train.nproc} processes "
        f"({params.train.strategy}): torchrun through Ray",
    )
    rec = torchrun.run_across_nodes(
        c,
        params.train.nproc,
        __name__,
        worker,
        before_attempt=before_attempt,
        check_nodes=lambda nodes: preflight.check(nodes, c, params.verifier.path),
        exclude=frozenset(n.node_id for n in pools.inference) if pools else frozenset(),
        env_for=pools.trainer_env if pools else lambda node: {},
        servers_lost=pools.newly_lost if pools else lambda: [],
    )
    if pools:
        rec["online"] = pools.served()
    record.write(inputs.record_as, rec)


def _die_with_agent() -> None:
    """SIGKILL this worker when its torchrun agent dies (a lost node's agent, SIGKILL included):
    a worker orphaned by its agent must not write beside the relaunched run."""
    import ctypes
    import signal

    parent = os.getppid()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the agent died before the signal was armed
        os._exit(1)


def _worker_main(argv: list[str]) -> int:
    """One torchrun worker: `python -m eagle3_pipeline.stages.train --worker PARAMS_JSON`."""
    if len(argv) != 2 or argv[0] != "--worker":
        print("usage: python -m eagle3_pipeline.stages.train --worker PARAMS_JSON", file=sys.stderr)
        return 2
    _die_with_agent()
    params = Params.model_validate_json(Path(argv[1]).read_text())
    if not sys.stdout.isatty():
        os.environ.setdefault("TQDM_DISABLE", "1")
    o = params.train.online
    flags, source = None, None
    if params.train.hidden_states == "online" and o.endpoint:
        endpoint = online.endpoint_for_rank(o.endpoint)
        flags = online.speculators_flags(o, endpoint)
        source = online.OnlineSource(endpoint, f"the vLLM server at {endpoint}")
    try:
        _train(params, _inputs(params), flags, source)
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(_worker_main(sys.argv[1:]))
