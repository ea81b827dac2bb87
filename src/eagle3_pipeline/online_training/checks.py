"""Online training's server checked before step one, and the params its workers read.

Before the first step the server's hidden states of the first stored row are compared with the
store's (online_training/source.py `check_server`): another model, revision or layer ids is
refused in one line, not found after an epoch. Workers launched through torchrun read the server
(and the Mooncake master) from the params the driver writes (`served_by`).
"""

from __future__ import annotations

import argparse

from eagle3_pipeline.config.params import Params
from eagle3_pipeline.core.progress import log
from eagle3_pipeline.online_training import source as online
from eagle3_pipeline.training.inputs import TrainInputs, run_settings
from eagle3_pipeline.training.run import build_train_config

STAGE = "train"


def check_and_log(
    params: Params, inputs: TrainInputs, source: online.OnlineSource, servers: int = 1
) -> dict:
    """Log the plan, check the server against the store; speculators' online flags."""
    t = params.train
    stored = sum(s["hidden_states_file"] is not None for s in inputs.samples)
    online.log_plan(t.online, source, len(inputs.samples), stored, servers)
    flags = online.speculators_flags(t.online, source.endpoint)
    check_server(params, inputs, source, flags)
    return flags


def served_by(params: Params, source: online.OnlineSource, master: str | None = None) -> Params:
    """Params whose train.online names this server (and Mooncake master): what workers read."""
    o = params.train.online
    update: dict = {"endpoint": source.endpoint}
    if master:
        update["mooncake"] = o.mooncake.model_copy(update={"master": master})
    train = params.train.model_copy(update={"online": o.model_copy(update=update)})
    return params.model_copy(update={"train": train})


def check_server(
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
    args = argparse.Namespace(**build_train_config(run_settings(params, inputs, flags)).flatten())
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
