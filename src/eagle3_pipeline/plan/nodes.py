"""`eagle3 plan` on a Ray cluster (cluster.engine: ray): each node's work, disk and time.

The plan's own totals split as the engine splits them. generate leases prompts to one vLLM
server per inference node and extract runs shard i of n on node i (batches i, i+n, ... of one
length-sorted plan), so each inference node takes an even share of the samples and their
tokens; its share of the store is written to the shared data/. train runs train.nproc ranks
on each training node, each rank reading its own samples; one rank writes the checkpoints.

Times are each share's tokens over a reference rate (RATES: where each figure comes from is
printed beside it), so they scale with the counts; a stage's time is that of its slowest node.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from eagle3_pipeline.config.params import Params


@dataclass(frozen=True)
class Rates:
    """Reference throughputs that turn a node's tokens into time."""

    decode_per_request: float  # tokens/s one generate request decodes
    extract_per_node: float  # tokens/s one node's vLLM prefills and extract writes
    train_per_rank: float  # tokens/s one training rank trains on
    source: str


RATES = {
    "gpu": Rates(
        30.0,
        3_000.0,
        49_000.0,
        "H200, Kimi-K2.5: extract 3,000 tokens/s per node (vLLM TP 8) and train 49,000 per "
        "GPU from an earlier run (docs/gpus.md); decode 30 per request assumed (not measured)",
    ),
    "cpu": Rates(
        5.0,
        790.0,
        400.0,
        "2-core CPU, tiny-llama: extract 790 tokens/s per node and train 400 per process, "
        "assumed (bench/bench_online.py measured them; its results are not committed); decode "
        "5 per request assumed (not measured)",
    ),
}


def rates_for(params: Params) -> Rates:
    """GPU rates when the profile is sized for GPUs (vllm.gpu_memory_gib or GPU workers)."""
    on_gpu = params.vllm.gpu_memory_gib is not None or params.cluster.worker.num_gpus > 0
    return RATES["gpu" if on_gpu else "cpu"]


def split(total: int, parts: int) -> list[int]:
    """`total` in `parts` shares as even as integers allow (the first ones one larger)."""
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


@dataclass(frozen=True)
class InferenceShare:
    """One inference node: its prompts (generate) and its shard of the hidden states (extract)."""

    samples: int
    tokens: int  # prompt + answer tokens of its samples
    new_tokens: int  # tokens its vLLM server generates (upper bound: every answer runs out)
    store_tokens: int  # hidden-state tokens its extract shard writes (online: val kept only)
    store_bytes: int  # in extract.store_dtype, written to the shared data/
    generate_s: float
    extract_s: float


@dataclass(frozen=True)
class TrainShare:
    """One training node: train.nproc ranks over its share of every epoch's tokens."""

    ranks: int
    tokens_per_epoch: int
    writes_checkpoints: bool
    train_s: float


@dataclass(frozen=True)
class ClusterPlan:
    address: str
    worker_cpus: float
    worker_gpus: float
    max_attempts: int
    concurrency: int  # requests in flight per generate server
    rates: Rates
    verifier_bytes: int | None  # weights every inference node reads at verifier.path
    inference: list[InferenceShare]  # empty: the sample count is unknown
    training: list[TrainShare]
    epochs: int
    curve_share: float = 0.0  # sum of curve.fractions: their training over train's

    @property
    def stage_seconds(self) -> dict[str, float]:
        """Each fanned-out stage's time: its slowest node's; the learning curve's fractions
        train on the training nodes as train does, on their share of the rows."""
        seconds = {
            "generate": max((s.generate_s for s in self.inference), default=0.0),
            "extract": max((s.extract_s for s in self.inference), default=0.0),
            "train": max((s.train_s for s in self.training), default=0.0),
        }
        if self.curve_share:
            seconds["curve_train"] = self.curve_share * seconds["train"]
        return seconds


def inference_shares(
    params: Params,
    nodes: int,
    samples: int,
    tokens: int,
    prompt_tokens: int,
    disk_tokens: int | None,
    bytes_per_token: int,
    concurrency: int,
) -> list[InferenceShare]:
    """Each of `nodes` inference nodes' even share of generate and extract."""
    r = rates_for(params)
    node_disk = split(disk_tokens if disk_tokens is not None else tokens, nodes)
    shares = []
    for n, t, d in zip(split(samples, nodes), split(tokens, nodes), node_disk, strict=True):
        new = max(0, t - n * prompt_tokens)
        shares.append(
            InferenceShare(
                samples=n,
                tokens=t,
                new_tokens=new,
                store_tokens=d,
                store_bytes=d * bytes_per_token,
                generate_s=new / (r.decode_per_request * concurrency),
                extract_s=d / r.extract_per_node,
            )
        )
    return shares


def train_shares(params: Params, nodes: int, train_tokens: int) -> list[TrainShare]:
    """Each of `nodes` training nodes' share of every epoch, train.nproc ranks each."""
    nproc, rate = params.train.nproc, rates_for(params).train_per_rank
    return [
        TrainShare(nproc, t, i == 0, params.train.epochs * t / (nproc * rate))
        for i, t in enumerate(split(train_tokens, nodes))
    ]


def concurrency_held(params: Params, max_concurrency: int | None) -> int:
    """Requests in flight per generate server: generate.concurrency, at most what the KV holds."""
    concurrency = params.generate.concurrency
    if max_concurrency is not None:
        concurrency = max(1, min(concurrency, max_concurrency))
    return concurrency


def cluster_plan(
    params: Params,
    samples: int | None,
    tokens: int | None,
    prompt_tokens: int,
    disk_tokens: int | None,
    bytes_per_token: int,
    train_tokens: int | None,
    max_concurrency: int | None = None,
    verifier_bytes: int | None = None,
) -> ClusterPlan | None:
    """Each node's share of the plan's totals; None unless cluster.engine is ray.

    disk_tokens: the hidden-state tokens the run's mode keeps on disk (store: every token);
    max_concurrency: the requests the KV cache holds at once, when the plan knows it.
    """
    c = params.cluster
    if c.engine != "ray":
        return None
    concurrency = concurrency_held(params, max_concurrency)
    inference: list[InferenceShare] = []
    if samples and tokens is not None:
        inference = inference_shares(
            params,
            c.nodes,
            samples,
            tokens,
            prompt_tokens,
            disk_tokens,
            bytes_per_token,
            concurrency,
        )
    training = (
        train_shares(params, c.training_nodes, train_tokens) if train_tokens is not None else []
    )
    return ClusterPlan(
        address=c.address,
        worker_cpus=c.worker.num_cpus,
        worker_gpus=c.worker.num_gpus,
        max_attempts=c.max_attempts,
        concurrency=concurrency,
        rates=rates_for(params),
        verifier_bytes=verifier_bytes,
        inference=inference,
        training=training,
        epochs=params.train.epochs,
        curve_share=sum(params.curve.fractions),
    )


def duration(seconds: float) -> str:
    """A time as people plan with it: minutes under two hours, hours under two days, else days."""
    if seconds < 60:
        return "< 1 min"
    if seconds < 2 * 3600:
        return f"{math.ceil(seconds / 60):,} min"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:,.1f} h"
    return f"{seconds / 86400:,.1f} d"
