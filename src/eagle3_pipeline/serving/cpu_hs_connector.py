"""A CPU-only variant of vLLM's ExampleHiddenStatesConnector, loaded by vLLM by module path.

vLLM 0.32's stock connector copies the hidden states to the host through CUDA streams and
`torch.empty_like(..., pin_memory=True)`, which on a CPU-only torch kills the engine with
`RuntimeError: pin_memory=True requires a CUDA or other accelerator backend`. This subclass
replaces only that copy: a plain CPU gather, written to disk on the connector's thread pool, with
an "event" that is already done. Everything else (file names, lock files, token ids) is the stock
behaviour, so readers written for the stock connector read our files too.

Used through kv_transfer_config: {"kv_connector": "CPUHiddenStatesConnector",
"kv_connector_module_path": "eagle3_pipeline.serving.cpu_hs_connector", ...}. Imports vLLM: only
vLLM (and code that already imported vLLM) should import this module.
"""

from __future__ import annotations

import fcntl
import os
from functools import partial

import torch
from vllm.distributed.kv_transfer.kv_connector.v1 import example_hidden_states_connector as _eh

CONNECTOR_NAME = "CPUHiddenStatesConnector"


class _DoneEvent:
    """Stands in for the CUDA copy event: on CPU the gather is finished when it returns."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class CPUHiddenStatesConnector(_eh.ExampleHiddenStatesConnector):
    """ExampleHiddenStatesConnector without CUDA streams or pinned memory."""

    def _slot_mapping(self, block_ids: list[int]) -> torch.Tensor:
        blocks = torch.tensor(block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        return (offsets.reshape(1, -1) + blocks.reshape(-1, 1) * self._block_size).flatten()

    def _take_lock_fd(self, pending: _eh.PendingSave) -> int | None:
        """The lock fd pre-created by wait_for_save, or a new one (readers flock it)."""
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            path = pending.filename + ".lock"
            lock_fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        return lock_fd

    def _submit_async_write(self, pending: _eh.PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        num_tokens = pending.token_ids.shape[0]
        slots = self._slot_mapping(pending.block_ids)
        hidden = _eh.extract_from_kv_cache(self._kv_cache, slots, num_tokens).clone()
        tensors = {"hidden_states": hidden, "token_ids": pending.token_ids.clone()}
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._take_lock_fd(pending)
        event = _DoneEvent()
        future = self._executor.submit(
            self._write_tensors, tensors, event, pending.filename, lock_fd
        )
        self._req_copy_events[pending.req_id] = event
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))
