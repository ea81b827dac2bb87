"""The train and cluster sections of params.yaml (config/params.py holds the whole schema):
what the drafter's norms do, how hidden states reach the trainer, the schedule, and the nodes
training and serving run on."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from eagle3_pipeline.config.families import FamilyParams


class Strict(BaseModel):
    """A params section: unknown keys are errors (a misspelling would silently use a default)."""

    model_config = ConfigDict(extra="forbid")


class DrafterFlagsParams(Strict):
    """What the drafter's norms do, in speculators'/vLLM's meaning.

    docs/conventions.md, "Drafter config flags", says what each tool means by each flag.

    null = the init checkpoint's (train.init_from), or speculators 0.9's trainer defaults
    without one (norm_before_residual, norm_before_fc and norm_output true, fc_norm false).
    """

    norm_before_residual: bool | None = None
    norm_before_fc: bool | None = None
    fc_norm: bool | None = None
    norm_output: bool | None = None


class MooncakeParams(Strict):
    """hs_connectors' `mooncake` backend: hidden states through a Mooncake store, no shared disk."""

    master: str = "127.0.0.1:50051"  # host:port of `mooncake_master`
    metadata_server: str = "P2PHANDSHAKE"
    protocol: Literal["tcp", "rdma"] = "tcp"
    device: str = ""  # RDMA device(s), e.g. mlx5_0; empty: Mooncake chooses
    global_segment_gib: float = Field(4.0, gt=0)
    local_buffer_gib: float = Field(2.0, gt=0)
    # The address this trainer registers with the master (MOONCAKE_LOCAL_HOSTNAME); null: the
    # host's own.
    local_hostname: str | None = None


class OnlineParams(Strict):
    """Where train gets hidden states when train.hidden_states is `online` (docs/online.md)."""

    # A running vLLM server of the verifier with `extract_hidden_states` (its /v1 URL); null:
    # the train stage starts one on this machine and stops it when training ends.
    endpoint: str | None = None
    # file: the server writes safetensors files to a folder the trainer reads (one machine, or a
    # shared filesystem); mooncake: through a Mooncake store (two machines, no shared disk).
    backend: Literal["file", "mooncake"] = "file"
    request_timeout_s: float = Field(120.0, gt=0)  # one request to the server
    max_retries: int = Field(3, ge=0)  # per request, backoff 2, 4, 8... s
    # Whole round trips (request, load, check) retried before the sample is refused by name.
    round_trip_retries: int = Field(1, ge=0)
    mooncake: MooncakeParams = Field(default_factory=MooncakeParams)


class TrainParams(Strict):
    # store: train reads the extract stage's store. online: vLLM computes each sample's hidden
    # states while train runs (no training store on disk; extract keeps only what evaluate
    # simulates on). See docs/online.md.
    hidden_states: Literal["store", "online"] = "store"
    online: OnlineParams = Field(default_factory=OnlineParams)
    epochs: int = Field(30, ge=1)
    lr: float = Field(3e-3, gt=0)
    scheduler: Literal["cosine", "linear", "none"] = "cosine"
    warmup_ratio: float = Field(0.01, ge=0.0, lt=1.0)
    noise_std: float = Field(0.0, ge=0.0)
    ttt_steps: int = Field(3, ge=1)
    ttt_step_loss_decay: float = Field(1.0, gt=0.0)
    max_tokens_per_batch: int = Field(2048, ge=8)
    num_workers: int = Field(0, ge=0)
    seed: int = 0
    init_from: str | None = None
    # Start the drafter's decoder layer and final norm from the verifier's last layer (where
    # the shapes allow; embeddings and lm_head rows always come from the verifier).
    init_from_verifier: bool = False
    # When init_from's vocab mapping differs from this run's: remap lm_head rows by target id,
    # or refuse naming both mappings.
    init_vocab_mismatch: Literal["remap", "refuse"] = "remap"
    # When layers or train.flags differ from what init_from was trained with: refuse naming both
    # values, or allow (those tensors are retrained on this run's features and wiring).
    init_mismatch: Literal["refuse", "allow"] = "refuse"
    flags: DrafterFlagsParams = Field(default_factory=DrafterFlagsParams)
    train_lm_head: bool = True
    log_every_steps: int = Field(10, ge=1)
    grad_accumulation: int = Field(1, ge=1)
    # Epoch checkpoints kept in the scratch folder (the best one is always kept on top).
    keep_last: int | None = Field(2, ge=1)
    # Processes (GPUs) for training; > 1 launches through torchrun.
    nproc: int = Field(1, ge=1)
    strategy: Literal["ddp", "fsdp"] = "ddp"
    # The drafter family and its knobs (docs/families.md); eagle3 by default.
    family: FamilyParams = Field(default_factory=FamilyParams)
    # Training arithmetic on a machine without a GPU (a GPU always trains in bf16): bfloat16
    # where the CPU has bf16 instructions (avx512_bf16, AMX), measured 1.3x faster per step.
    cpu_dtype: Literal["float32", "bfloat16"] = "float32"

    @model_validator(mode="after")
    def _one_init(self) -> TrainParams:
        if self.init_from and self.init_from_verifier:
            raise ValueError(
                "train.init_from and train.init_from_verifier both set: a run starts from one "
                "drafter; remove one"
            )
        return self

    @model_validator(mode="after")
    def _init_from_is_eagle3(self) -> TrainParams:
        if self.init_from and self.family.name != "eagle3":
            raise ValueError(
                f"train.init_from loads an EAGLE-3 drafter; family {self.family.name} trains "
                "from scratch: remove train.init_from or set train.family.name: eagle3"
            )
        return self

    @model_validator(mode="after")
    def _online_workers_send_the_key(self) -> TrainParams:
        """The server train starts wants this run's key; speculators 0.9's loader workers are
        spawned processes whose client sends "EMPTY" (the project's key patch lives in this
        process only): every sample would fail with HTTP 401, after the long stages."""
        if self.hidden_states == "online" and self.num_workers > 0 and not self.online.endpoint:
            raise ValueError(
                f"train.num_workers={self.num_workers} with train.hidden_states: online: "
                "speculators' loader workers would not send the key of the server train starts "
                "(docs/upstream/online-api-key.patch): set train.num_workers: 0"
            )
        return self


class ClusterWorkerParams(Strict):
    """Ray resources one worker (one node's share of a stage) asks for."""

    num_cpus: float = Field(1.0, gt=0)
    num_gpus: float = Field(0.0, ge=0)


class ClusterParams(Strict):
    """Where stages run (docs/cluster.md): this machine, or `nodes` nodes of a Ray cluster.

    The engine decides where work runs, never what it computes: generated rows and the store are
    the same bytes either way. Only the number of training processes (nodes x train.nproc)
    changes what train computes, so `cluster.nodes` is a train param in dvc.yaml.
    """

    engine: Literal["local", "ray"] = "local"
    # Ray's GCS address (host:port); auto: the cluster this node belongs to (RAY_ADDRESS, or the
    # one `make cluster-local` started).
    address: str = "auto"
    # Nodes for generate and extract (one vLLM each) and, unless train_nodes says otherwise,
    # for train (torchrun, train.nproc processes per node).
    nodes: int = Field(1, ge=1)
    # Nodes for train when they differ from the inference nodes (TorchSpec's shape: 2 inference
    # + 2 training nodes); null: `nodes`.
    train_nodes: int | None = Field(None, ge=1)
    worker: ClusterWorkerParams = Field(default_factory=ClusterWorkerParams)
    # A worker lost mid-stage (its node died, its process was killed): its share reruns on
    # another node, resuming from what it had journaled, at most this many times per share.
    max_attempts: int = Field(3, ge=1)
    # torchrun's c10d rendezvous port on the first training node.
    rdzv_port: int = Field(29400, ge=1024, le=65535)
    # Seconds to wait for `nodes` alive nodes before refusing.
    wait_for_nodes_s: float = Field(60.0, ge=0)

    @model_validator(mode="after")
    def _local_is_one_node(self) -> ClusterParams:
        for key in ("nodes", "train_nodes"):
            n = getattr(self, key)
            if self.engine == "local" and n not in (None, 1):
                raise ValueError(
                    f"cluster.{key}={n} needs cluster.engine: ray (engine local runs on this "
                    f"machine alone): set cluster.engine: ray, or cluster.{key}: 1"
                )
        return self

    @property
    def training_nodes(self) -> int:
        return self.train_nodes or self.nodes
