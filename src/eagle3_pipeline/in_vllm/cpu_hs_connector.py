"""vLLM's ExampleHiddenStatesConnector, made to report failed writes; and a CPU-only variant.

Loaded by vLLM by module path. The stock connector writes each file in place and, when the write
fails (disk full, I/O error), only logs it: the file never appears (or appears torn) and the
reader waits for its full timeout. `ReportingHiddenStatesConnector` writes to `<file>.part`,
renames it when complete, and on failure renames the request's `.lock` file (already on disk, so
no new block is needed on a full disk) to `<file>.failed-<errno>` before releasing it: the reader
(serving/hidden_states.py) sees the OS's reason at once. GPU runs use it as is.

vLLM 0.32's stock connector copies the hidden states to the host through CUDA streams and
`torch.empty_like(..., pin_memory=True)`, which on a CPU-only torch kills the engine with
`RuntimeError: pin_memory=True requires a CUDA or other accelerator backend`.
CPUHiddenStatesConnector replaces only that copy: a plain CPU gather, written to disk on the
connector's thread pool, with an "event" that is already done. Everything else (file names,
lock files, token ids) is the stock behaviour, so readers written for the stock connector read
our files too.

Used through kv_transfer_config: {"kv_connector": "HiddenStatesConnector",
"kv_connector_module_path": "eagle3_pipeline.in_vllm.cpu_hs_connector", ...}: the name resolves,
in the process vLLM loads it in, to the class for that machine, so a CPU driver that writes the
config for a server on a GPU node (online mode on a cluster) names the right one. Imports vLLM:
only vLLM (and code that already imported vLLM) should import this module.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
from functools import partial

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1 import example_hidden_states_connector as _eh

CONNECTOR_NAME = "HiddenStatesConnector"  # resolved by __getattr__ where vLLM runs
FAILED_SUFFIX = ".failed-"  # <file>.failed-<errno>: the write of <file> failed with that errno


class _DoneEvent:
    """Stands in for the CUDA copy event: on CPU the gather is finished when it returns."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


def _errno_of(exc: BaseException) -> int:
    """safetensors reports `I/O error: No space left on device (os error 28)` as text only."""
    if isinstance(exc, OSError) and exc.errno:
        return exc.errno
    found = re.search(r"\(os error (\d+)\)", str(exc))
    return int(found.group(1)) if found else errno.EIO


def write_or_report(tensors: dict[str, torch.Tensor], filename: str, lock_fd: int | None) -> None:
    """Write `filename` whole (temp + rename) or leave `<filename>.failed-<errno>`; then unlock."""
    part = filename + ".part"
    try:
        save_file(tensors, part)
        os.replace(part, filename)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(part)
        code = _errno_of(exc)
        failed = f"{filename}{FAILED_SUFFIX}{code}"
        try:
            os.replace(filename + ".lock", failed)  # a rename: no new block on a full disk
        except OSError:
            with contextlib.suppress(OSError):
                os.close(os.open(failed, os.O_CREAT | os.O_WRONLY, 0o644))
        raise
    finally:
        if lock_fd is not None:
            os.close(lock_fd)  # releases LOCK_EX


class ReportingHiddenStatesConnector(_eh.ExampleHiddenStatesConnector):
    """The stock connector; a failed write leaves a marker the reader turns into an error."""

    @staticmethod
    def _write_tensors(
        tensors: dict[str, torch.Tensor], event, filename: str, lock_fd: int | None
    ) -> None:
        try:
            event.synchronize()
        except BaseException:
            if lock_fd is not None:
                os.close(lock_fd)
            raise
        write_or_report(tensors, filename, lock_fd)


class CPUHiddenStatesConnector(ReportingHiddenStatesConnector):
    """ReportingHiddenStatesConnector without CUDA streams or pinned memory."""

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


def __getattr__(name: str) -> type:
    """`HiddenStatesConnector`: the connector for this process's machine (vLLM's factory looks
    the class up with getattr in the serving process)."""
    if name == CONNECTOR_NAME:
        gpu = torch.cuda.is_available()
        return ReportingHiddenStatesConnector if gpu else CPUHiddenStatesConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
