"""A view of the store for a drafter that reads some of its layers: hs_connectors backend
`layer_view`.

A store holds the union of the layers every drafter family needs (layers.family_aux_layer_ids);
each run reads its own aux layers, then the final one, in its own order, from the same files:
no copies. speculators' dataloader asks its backend for each row's tensors (`get_cached`), so
the view is a registered backend, found by speculators' `--hidden-states-backend layer_view`
like its own. It reads the store's files as the `fp8` backend does (bf16 as is, fp8
dequantized) and keeps `--layer-view-positions` of the layer axis. A server's hidden states
(`get_generated`, online mode) pass through whole: that server captures the run's layers only.

speculators collects every backend's flags when its config module is first imported, so this
module must be imported before it (training.run imports it at the top).
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from hs_connectors import HiddenStatesBackend
from hs_connectors.transfer import FP8Backend, FP8Transfer, HiddenStatesTransfer

NAME = "layer_view"


class LayerViewTransfer(HiddenStatesTransfer):
    """The store's rows with the layer axis cut to `positions` (final layer last)."""

    def __init__(self, inner: FP8Transfer, positions: list[int]) -> None:
        self.inner = inner
        self.positions = torch.tensor(positions, dtype=torch.long)

    def setup(self) -> None:
        self.inner.setup()

    def get_cached(self, file_idx: int) -> dict[str, torch.Tensor] | None:
        sample = self.inner.get_cached(file_idx)
        if sample is None:
            return None
        hidden = sample["hidden_states"]  # [seq, store layers, hidden]
        if int(self.positions.max()) >= hidden.shape[1]:
            raise ValueError(
                f"hs_{file_idx}.safetensors holds {hidden.shape[1]} layers, the view reads "
                f"positions {self.positions.tolist()}: rerun extract"
            )
        return sample | {"hidden_states": hidden.index_select(1, self.positions)}

    def get_generated(self, hs_transfer_params: dict[str, Any]) -> dict[str, torch.Tensor] | None:
        return self.inner.get_generated(hs_transfer_params)

    def delete(self, handle: str) -> None:
        self.inner.delete(handle)


def _positions(text: str) -> list[int]:
    return [int(p) for p in text.replace(",", " ").split()]


if NAME not in HiddenStatesBackend.registry:  # a second import registers nothing

    @HiddenStatesBackend.register(NAME)
    class LayerViewBackend(HiddenStatesBackend):
        """`fp8`'s file reading, with the layer axis cut to the run's layers."""

        @staticmethod
        def add_train_args(parser: argparse.ArgumentParser) -> None:
            FP8Backend.add_train_args(parser)  # --hidden-states-path, shared with file/fp8
            parser.add_argument(
                "--layer-view-positions",
                type=str,
                default=None,
                help="Positions in the store files' layer axis of the run's aux layers, then "
                "the final layer (space- or comma-separated)",
            )

        @staticmethod
        def add_launch_args(parser: argparse.ArgumentParser) -> None:
            FP8Backend.add_launch_args(parser)

        @staticmethod
        def from_train_args(args: argparse.Namespace, data_path: str) -> LayerViewTransfer:
            if not args.layer_view_positions:
                raise ValueError(f"--hidden-states-backend {NAME} needs --layer-view-positions")
            inner = FP8Backend.from_train_args(args, data_path)
            return LayerViewTransfer(inner, _positions(args.layer_view_positions))

        @staticmethod
        def build_kv_transfer_config(args: argparse.Namespace) -> dict[str, Any]:
            return FP8Backend.build_kv_transfer_config(args)


def flags(positions: list[int] | None) -> dict[str, Any]:
    """speculators train flags that read `positions` of each file; none when the run reads
    every layer in the store's order (the final one is always the file's last)."""
    if positions is None or positions == list(range(len(positions))):
        return {}
    return {"hidden_states_backend": NAME, "layer_view_positions": ",".join(map(str, positions))}
