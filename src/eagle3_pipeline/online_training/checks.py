"""Online training's server checked before step one, and the train params its workers read.

Before the first step the server's hidden states of the first stored row are compared with the
store's (online_training/source.py `check_server`): another model, revision or layer ids is
refused in one line, not found after an epoch. Workers launched through torchrun read the server
(and the Mooncake master) from the run the driver resolves with `served_by`'s train params.
"""

from __future__ import annotations

import argparse
import dataclasses

from eagle3_pipeline.config.training_params import TrainParams
from eagle3_pipeline.core.progress import log
from eagle3_pipeline.online_training import source as online
from eagle3_pipeline.training.inputs import TrainInputs
from eagle3_pipeline.training.run import TrainSettings, build_train_config

STAGE = "train"


def check_and_log(
    settings: TrainSettings, inputs: TrainInputs, source: online.OnlineSource, servers: int = 1
) -> dict:
    """Log the plan, check the server against the store; speculators' online flags."""
    t = settings.train
    stored = sum(s["hidden_states_file"] is not None for s in inputs.samples)
    online.log_plan(t.online, source, len(inputs.samples), stored, servers)
    flags = online.speculators_flags(t.online, source.endpoint)
    check_server(settings, inputs, source, flags)
    return flags


def served_by(
    t: TrainParams, source: online.OnlineSource, master: str | None = None
) -> TrainParams:
    """Train params whose online section names this server (and Mooncake master): what the
    workers' resolved run holds."""
    o = t.online
    update: dict = {"endpoint": source.endpoint}
    if master:
        update["mooncake"] = o.mooncake.model_copy(update={"master": master})
    return t.model_copy(update={"online": o.model_copy(update=update)})


def check_server(
    settings: TrainSettings, inputs: TrainInputs, source: online.OnlineSource, flags: dict
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
    run = dataclasses.replace(settings, online_flags=flags)
    args = argparse.Namespace(**build_train_config(run).flatten())
    worst = online.check_server(
        source,
        args,
        inputs.samples[row]["input_ids"],
        stored["hidden_states"],
        inputs.row_ids[row],
        str(settings.verifier_dir),
    )
    log(
        STAGE,
        f"server checked on sample {inputs.row_ids[row]}: largest difference from the store "
        f"{worst:.2%} of a layer's range (accepted {online.PROBE_TOLERANCE:.0%})",
    )
