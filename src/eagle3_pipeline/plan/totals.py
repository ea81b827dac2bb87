"""What every plan ends on: the GPUs it needs, the disk per node and in all, and the hours.

One node (cluster.engine: local), or the Ray cluster's inference nodes plus its training nodes
when train_nodes sets them apart. Disk: the verifier's weights on every node (memory.py's one
figure, from its checkpoint index or counted from its config), and on data/ (shared by the
nodes) the hidden states the run's mode keeps plus the epoch checkpoints train keeps, and the
learning curve's fractions' checkpoints (curve_cost.fraction_checkpoint_bytes). Hours: each
stage's tokens over nodes.py's reference rates (where they come from is printed beside them);
online mode adds the prefill train asks the verifier for in every epoch; curve.fractions adds
`curve_train`, the fractions' training: sum(F) times train's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3_pipeline.config.params import Params
from eagle3_pipeline.core.errors import PipelineError
from eagle3_pipeline.plan import modes, nodes
from eagle3_pipeline.plan.memory import Weights, weight_bytes


@dataclass(frozen=True)
class Totals:
    nodes: int
    gpus_per_node: int  # 0: a CPU profile
    gpu_gib: float | None  # vllm.gpu_memory_gib
    weights: Weights | None  # the verifier's, on every node (None: its config does not say)
    store_bytes: int | None  # hidden states on disk in the run's mode (None: count unknown)
    checkpoint_bytes: int  # the epoch checkpoints train keeps
    seconds: dict[str, float] | None  # each stage in turn (None: sample count unknown)
    rates: nodes.Rates
    curve_bytes: int = 0  # the learning curve's fractions: their checkpoints and weights

    @property
    def shared_bytes(self) -> int | None:
        """data/ and models/: the store and the checkpoints (one copy, shared by every node)."""
        if self.store_bytes is None:
            return None
        return self.store_bytes + self.checkpoint_bytes + self.curve_bytes

    @property
    def total_bytes(self) -> int | None:
        shared = self.shared_bytes
        if shared is None or self.weights is None:
            return None
        return self.weights.bytes * self.nodes + shared


def node_count(params: Params) -> int:
    """Machines the run takes: one, or the inference nodes plus separate training nodes."""
    c = params.cluster
    if c.engine != "ray":
        return 1
    return c.nodes + (c.train_nodes or 0)


def gpus_per_node(params: Params) -> int:
    """GPUs one node needs: a Ray worker's, else the larger of vLLM's TP and train's ranks."""
    if nodes.rates_for(params) is nodes.RATES["cpu"]:
        return 0
    if params.cluster.engine == "ray" and params.cluster.worker.num_gpus > 0:
        return int(params.cluster.worker.num_gpus)
    return max(params.vllm.tensor_parallel_size, params.train.nproc)


def stage_seconds(
    params: Params,
    own: modes.ScaleCost | None,
    prompt_tokens: int,
    train_tokens: int | None,
    max_concurrency: int | None,
) -> dict[str, float] | None:
    """generate, extract and train in turn, each as long as its slowest node; online mode's
    per-epoch prefill beside them; the learning curve's fractions' training after (each fraction
    F trains as train does on F of its rows). None when the sample count is unknown."""
    if own is None or train_tokens is None:
        return None
    c, cost = params.cluster, getattr(own, params.train.hidden_states)
    n_inf = c.nodes if c.engine == "ray" else 1
    n_train = c.training_nodes if c.engine == "ray" else 1
    concurrency = nodes.concurrency_held(params, max_concurrency)
    inference = nodes.inference_shares(
        params, n_inf, own.samples, own.tokens, prompt_tokens, cost.disk_tokens, 1, concurrency
    )
    training = nodes.train_shares(params, n_train, train_tokens)
    seconds = {
        "generate": max(s.generate_s for s in inference),
        "extract": max(s.extract_s for s in inference),
        "train": max(t.train_s for t in training),
    }
    prefill = cost.prefill_tokens - cost.disk_tokens  # online: what train asks the verifier for
    if prefill > 0:
        seconds["online prefill"] = prefill / (nodes.rates_for(params).extract_per_node * n_inf)
    if params.curve.fractions:
        seconds["curve_train"] = sum(params.curve.fractions) * seconds["train"]
    return seconds


def verifier_weights(config: dict[str, Any], config_file: Path | None) -> Weights | None:
    """memory.weight_bytes, or None for a config too sparse to count (no head count, say)."""
    try:
        return weight_bytes(config, config_file)
    except (KeyError, TypeError, ValueError, PipelineError):
        return None


def totals(
    params: Params,
    weights: Weights | None,
    own: modes.ScaleCost | None,
    store_bytes: int | None,
    checkpoint_bytes: int,
    prompt_tokens: int,
    train_tokens: int | None,
    max_concurrency: int | None,
    curve_bytes: int = 0,
) -> Totals:
    return Totals(
        nodes=node_count(params),
        gpus_per_node=gpus_per_node(params),
        gpu_gib=params.vllm.gpu_memory_gib,
        weights=weights,
        store_bytes=store_bytes,
        checkpoint_bytes=checkpoint_bytes,
        seconds=stage_seconds(params, own, prompt_tokens, train_tokens, max_concurrency),
        rates=nodes.rates_for(params),
        curve_bytes=curve_bytes,
    )
