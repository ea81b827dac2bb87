"""The hidden-states backend of online training as speculators' train flags.

`train.online.backend` picks the hs_connectors backend that speculators' dataloader reads the
server's hidden states through: `file` (the server writes safetensors files the trainer reads: one
machine or a shared filesystem) or `mooncake` (a Mooncake store: vLLM on one machine, the trainer
on another, no shared disk; docs/online.md). `speculators_flags` and `mooncake_env` are
pure; `backend_dests` asks hs_connectors' registry.

speculators keeps a backend's own flags (`mooncake_*`, `hidden_states_path`) outside its pydantic
schema: `TrainConfig.from_sources` takes them as `backend_cli=`, and the same keys passed in `cli=`
are dropped without a word and replaced by the backend's defaults (a master at 127.0.0.1:50051).
`split_backend_flags` separates the two.
"""

from __future__ import annotations

import argparse
from functools import cache
from typing import Any

from eagle3_pipeline.config.training_params import OnlineParams

# hs_connectors reads the address a client registers with the master from this variable, else
# the address the host's own name resolves to (often 127.0.1.1 on Debian/Ubuntu: unreachable
# from the other machine).
LOCAL_HOSTNAME_VAR = "MOONCAKE_LOCAL_HOSTNAME"


def speculators_flags(online: OnlineParams) -> dict[str, Any]:
    """speculators' train flags that select and configure the hidden-states backend."""
    if online.backend == "file":
        # hs_connectors' file backend that also dequantizes fp8 stores (the store mode's): it
        # reads the server's files and the stored rows (data_path/hidden_states) alike.
        return {"hidden_states_backend": "fp8"}
    m = online.mooncake
    return {
        "hidden_states_backend": "mooncake",
        "mooncake_master": m.master,
        "mooncake_metadata_server": m.metadata_server,
        "mooncake_protocol": m.protocol,
        "mooncake_device": m.device,
        "mooncake_global_segment_gib": m.global_segment_gib,
        "mooncake_local_buffer_gib": m.local_buffer_gib,
    }


def mooncake_env(online: OnlineParams) -> dict[str, str]:
    """Environment the trainer process needs for the backend (empty: none)."""
    if online.backend == "mooncake" and online.mooncake.local_hostname:
        return {LOCAL_HOSTNAME_VAR: online.mooncake.local_hostname}
    return {}


@cache
def backend_dests() -> frozenset[str]:
    """Every flag an hs_connectors backend adds to speculators' trainer (its add_train_args)."""
    from hs_connectors import HiddenStatesBackend

    dests: set[str] = set()
    for backend in HiddenStatesBackend.registry.values():
        parser = argparse.ArgumentParser(add_help=False)
        backend.add_train_args(parser)
        dests |= set(vars(parser.parse_args([])))
    return frozenset(dests)


def split_backend_flags(flags: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(schema flags, backend flags): `TrainConfig.from_sources(cli=..., backend_cli=...)`."""
    backend = backend_dests()
    return (
        {k: v for k, v in flags.items() if k not in backend},
        {k: v for k, v in flags.items() if k in backend},
    )
