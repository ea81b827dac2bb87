"""What every process of one training run derives alike from params and the stage's inputs.

The `train` stage builds a `TrainInputs` (training/family rows, the run's conventions, its scratch
folder) once per process: the driver, and each torchrun worker again from the params the driver
wrote. `settings` turns params and inputs into the run's TrainSettings; `nodes` and `distributed`
say how many machines and processes train (training/launch.py launches them).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from eagle3_pipeline.config.params import Params
from eagle3_pipeline.core import paths
from eagle3_pipeline.drafter.conventions import RunConventions
from eagle3_pipeline.training.data import TrainingSample, train_data_ratio_for
from eagle3_pipeline.training.run import TrainSettings

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


def run_settings(
    params: Params,
    inputs: TrainInputs,
    online_flags: dict | None,
    online_api_key: str | None = None,
) -> TrainSettings:
    """The run's TrainSettings; `online_flags` and `online_api_key`: online mode's
    (online_training/source.py)."""
    found = TrainSettings.from_params(
        params.train,
        data_dir=inputs.data_dir,
        save_dir=inputs.save_dir,
        verifier_dir=Path(params.verifier.path),
        vocab_dir=paths.VOCAB,
        draft_vocab_size=params.vocab.draft_vocab_size,
        conventions=inputs.conventions,
        train_data_ratio=train_data_ratio_for(inputs.n_train, len(inputs.samples)),
        nodes=nodes(params),
        mask_token_id=inputs.mask[0] if inputs.mask else None,
        store_positions=inputs.positions,
        verifier_num_layers=inputs.final,
    )
    return dataclasses.replace(found, online_flags=online_flags, online_api_key=online_api_key)


def nodes(params: Params) -> int:
    """Training nodes: cluster.training_nodes on a Ray cluster, else this machine alone."""
    return params.cluster.training_nodes if params.cluster.engine == "ray" else 1


def distributed(params: Params) -> bool:
    """More than one training process: launched through torchrun."""
    return params.train.nproc > 1 or nodes(params) > 1
