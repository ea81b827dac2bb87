"""Where a training job's hidden states come from for as long as it trains.

The store as it is (no server), or online a vLLM server of the verifier (the one
`train.online.endpoint` names, else one started here; on a Ray cluster, an inference pool and a
Mooncake master: online_training/pools.py), checked against the store before step one
(online_training/checks.py) and stopped when the training ends, whichever way it runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator

from eagle3_pipeline.online_training import pools as online_pools
from eagle3_pipeline.online_training import source as online
from eagle3_pipeline.online_training.checks import check_and_log, check_server, served_by
from eagle3_pipeline.training.inputs import TrainJob
from eagle3_pipeline.training.online_backend import mooncake_env
from eagle3_pipeline.training.run import TrainSettings


@dataclasses.dataclass(frozen=True)
class Served:
    """`settings`: what torchrun's workers train (the server named in their train section);
    `flags`: this process's trainer's online flags; `source`: the server it reads; `pools`: the
    cluster's inference pool (None: no pool)."""

    settings: TrainSettings
    flags: dict | None = None
    source: online.OnlineSource | None = None
    pools: online_pools.Pools | None = None


@contextlib.contextmanager
def served(job: TrainJob) -> Iterator[Served]:
    """The job's hidden-state source: the store, or its servers started, checked and stopped."""
    t, inputs, settings = job.train, job.inputs, job.settings
    if t.hidden_states != "online":
        yield Served(settings)
        return
    online.check_layer_order(inputs.aux, inputs.final)
    layer_ids = [*inputs.aux, inputs.final]
    if online_pools.uses_pools(t, job.cluster):
        # Across nodes: vLLM (and the Mooncake master) on the inference pool, torchrun on the
        # training pool.
        with online_pools.inference_pool(
            job.cluster, t.online, inputs.verifier, job.vllm, layer_ids, inputs.work
        ) as pools:
            flags = check_and_log(settings, inputs, pools.source, len(pools.sources))
            for other in pools.sources[1:]:  # every server, not only the one params name
                check_server(settings, inputs, other, flags)
            workers = dataclasses.replace(settings, train=served_by(t, pools.source, pools.master))
            yield Served(workers, flags, pools.source, pools)
        return
    os.environ.update(mooncake_env(t.online))  # torchrun workers inherit it
    with online.online_source(t.online, inputs.verifier, job.vllm, layer_ids, inputs.work) as src:
        os.environ.update(online.trainer_env(src))  # this process's trainer, or torchrun's
        flags = check_and_log(settings, inputs, src)
        if job.distributed:
            # Workers read the server from the run: the one started here, or the given one.
            settings = dataclasses.replace(settings, train=served_by(t, src))
        yield Served(settings, flags, src)
