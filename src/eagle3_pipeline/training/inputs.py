"""What one training run is, resolved once by the stage's process (the driver).

The `train` stage builds a `TrainInputs` (training/family rows, the run's conventions, its scratch
folder), turns params and inputs into the run's TrainSettings, and hands every branch one
`TrainJob` (those two, and the cluster and vLLM sections it runs on): the online servers
(online_training/served.py), the launcher and the publishing read the job, not params. Torchrun
workers get a `ResolvedRun` the driver writes to the run's scratch folder: they never rebuild the
run from params (nor hash the store again, nor lose a learning-curve fraction). `nodes` and
`distributed` say how many machines and processes train (training/launch.py launches them).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3_pipeline.config.params import VllmParams
from eagle3_pipeline.config.training_params import ClusterParams, TrainParams
from eagle3_pipeline.core import atomic
from eagle3_pipeline.drafter.conventions import RunConventions
from eagle3_pipeline.training.data import TrainingSample
from eagle3_pipeline.training.run import TrainSettings
from eagle3_pipeline.verifier.identity import VerifierFacts

STAGE = "train"


@dataclass(frozen=True)
class TrainInputs:
    """What every process of one run derives alike from params and the stage's inputs."""

    conventions: RunConventions
    samples: list[TrainingSample]
    n_train: int
    work: Path
    row_ids: list[str]  # sample id of each row, in the order speculators indexes them
    verifier: VerifierFacts  # as the stage read it, once (online mode serves it)
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


def nodes(c: ClusterParams) -> int:
    """Training nodes: cluster.training_nodes on a Ray cluster, else this machine alone."""
    return c.training_nodes if c.engine == "ray" else 1


def distributed(t: TrainParams, c: ClusterParams) -> bool:
    """More than one training process: launched through torchrun."""
    return t.nproc > 1 or nodes(c) > 1


# TrainSettings fields a worker sets itself: its rank's server, and the key kept out of files.
_PER_PROCESS = {"online_flags", "online_api_key"}


@dataclass(frozen=True)
class ResolvedRun:
    """What a torchrun worker trains: the driver's TrainSettings (online mode's per-rank flags and
    key left out), the sample id of each row (for a refused row's name) and where rank 0 logs."""

    settings: TrainSettings
    row_ids: list[str]
    live_dir: Path

    def write(self, path: Path) -> Path:
        settings: dict[str, Any] = {}
        for f in dataclasses.fields(self.settings):
            if f.name in _PER_PROCESS:
                continue
            value = getattr(self.settings, f.name)
            if isinstance(value, TrainParams):
                value = value.model_dump(mode="json")
            elif isinstance(value, Path):
                value = str(value)
            settings[f.name] = value
        record = {"settings": settings, "row_ids": self.row_ids, "live_dir": str(self.live_dir)}
        return atomic.write_json(path, record)

    @classmethod
    def read(cls, path: Path) -> ResolvedRun:
        record = json.loads(Path(path).read_text())
        settings = dict(record["settings"])
        settings["train"] = TrainParams.model_validate(settings["train"])
        for f in dataclasses.fields(TrainSettings):
            if f.type in ("Path", Path) and settings.get(f.name) is not None:
                settings[f.name] = Path(settings[f.name])
        return cls(TrainSettings(**settings), list(record["row_ids"]), Path(record["live_dir"]))


@dataclass(frozen=True)
class TrainJob:
    """The run as the driver resolved it, once: what every branch trains from (this process,
    torchrun, a Ray cluster; the store or an online server) and publishes."""

    settings: TrainSettings
    inputs: TrainInputs
    cluster: ClusterParams
    vllm: VllmParams  # online mode's servers

    @property
    def train(self) -> TrainParams:
        return self.settings.train

    @property
    def distributed(self) -> bool:
        return distributed(self.train, self.cluster)

    @property
    def world_size(self) -> int:
        """Training processes in all: the ranks whose loaders record their rows."""
        return self.train.nproc * nodes(self.cluster)

    def resolved(self, settings: TrainSettings | None = None) -> ResolvedRun:
        """What torchrun's workers train: `settings` (the job's unless an online server's)."""
        return ResolvedRun(settings or self.settings, self.inputs.row_ids, self.inputs.live_dir)
