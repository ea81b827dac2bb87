"""hs_connectors' Mooncake connector (vLLM side) on a CPU-only vLLM.

hs_connectors 0.9.0's `MooncakeHiddenStatesConnector` copies each sample on a device stream of
the active accelerator (`hs_connectors.device.accelerator_module()`), which raises "No
accelerator is available." without one. torch's `torch.cpu` module has the same stream API
(`Stream`, `Event`, `stream`), each a no-op: the gather is finished when it returns. This
variant takes it when there is no accelerator and changes nothing else (keys, layout, error
markers), so the trainer's side reads its objects as the stock connector's; on a machine with
an accelerator it is the stock connector.

Used through kv_transfer_config: {"kv_connector": "CPUMooncakeHiddenStatesConnector",
"kv_connector_module_path": "eagle3_pipeline.in_vllm.cpu_mooncake_connector", ...}. Imports
vLLM (through hs_connectors' connector): only vLLM should import this module.
"""

from __future__ import annotations

from typing import Any

import torch
from hs_connectors.mooncake_hidden_states_connector import MooncakeHiddenStatesConnector

CONNECTOR_NAME = "CPUMooncakeHiddenStatesConnector"


class CPUMooncakeHiddenStatesConnector(MooncakeHiddenStatesConnector):
    def _device(self) -> Any:
        if self._device_module is None:
            self._device_module = (
                torch.cpu if torch.accelerator.current_accelerator() is None else super()._device()
            )
        return self._device_module
