"""Hidden states from vLLM itself: an in-process engine with `extract_hidden_states` (extract),
and the same engine settings served (`hidden_state_spec`: what online training asks).

vLLM's `extract_hidden_states` speculative method stores, for every prompt token, the residual
stream at `eagle_aux_hidden_state_layer_ids` in a cache that a KV connector writes to one
safetensors file per request (`hidden_states [seq, n_ids, hidden]`, `token_ids [seq]`). We run
each prompt for one output token, read the file back and delete it; the caller writes the store.

Layer ids: vLLM collects id i after decoder layer i-1 (`hidden_states + residual`, i.e. the input
of layer i; id 0 = the embeddings) and id N after the last layer, before the final norm. That is
the project's convention (layer_ids.py), so ids pass through unchanged. The only translation is the
ORDER: vLLM collects layers in ascending order whatever order they were listed in, so
`vllm_layer_order` asks for them sorted and `HiddenStateEngine` permutes the result back.

The served verifier: the verifier's own dtype, layer ids in vLLM's ascending order, prefix caching
off and our connector, which writes one safetensors file per request to `storage_dir` and reports
the file in the response's `kv_transfer_params`. speculators' online dataloader sends each
sample's token ids with `max_tokens=1` and reads that file back (hs_connectors' `file` backend).
"""

from __future__ import annotations

import contextlib
import fcntl
import gc
import glob
import json
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from eagle3_pipeline.config.params import VllmParams
from eagle3_pipeline.core.errors import DataError, VerifierError
from eagle3_pipeline.core.progress import log
from eagle3_pipeline.in_vllm import entry_points
from eagle3_pipeline.serving import in_process
from eagle3_pipeline.serving.server import ServerSpec
from eagle3_pipeline.serving.server_spec import engine_dtype, model_args, verifier_spec
from eagle3_pipeline.verifier.identity import VerifierFacts

FAILED_SUFFIX = ".failed-"  # cpu_hs_connector.FAILED_SUFFIX, without importing vLLM
# in_vllm/cpu_hs_connector.py and its platform-resolved name, without importing vLLM.
CONNECTOR_NAME = "HiddenStatesConnector"


def vllm_layer_order(layer_ids: list[int]) -> tuple[list[int], list[int]]:
    """(ids in the order vLLM returns them, index of each of our ids in that order)."""
    ordered = sorted(layer_ids)
    return ordered, [ordered.index(i) for i in layer_ids]


def connector_config(storage_dir: Path) -> dict[str, Any]:
    """Our connector (cpu_hs_connector.py), loaded by vLLM by module path: on GPU the stock one
    that reports failed writes, on CPU a variant without pinned memory (the stock one pins memory
    and kills the engine); chosen where vLLM loads it."""
    return {
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": str(storage_dir.resolve())},
        "kv_connector": CONNECTOR_NAME,
        "kv_connector_module_path": entry_points.HIDDEN_STATES_CONNECTOR,
    }


# vLLM 0.32's DeepSeek-V2/V3 model (Kimi-K2.5's text model too) sums `hidden_states + residual`
# at an aux id before the first layer has made a residual: id 0 fails in the engine with
# `TypeError: unsupported operand type(s) for +: 'Tensor' and 'NoneType'`.
_NO_ID_ZERO = {"deepseek_v2", "deepseek_v3", "deepseek_v32", "kimi_k2"}


def check_layer_ids(model_type: str | None, layer_ids: list[int]) -> None:
    """Refuse, before vLLM's slow start, the ids vLLM's model for this verifier's text model
    type cannot capture."""
    if 0 in layer_ids and model_type in _NO_ID_ZERO:
        raise VerifierError(
            f"layers.aux_layer_ids contains 0 (the embeddings), which vLLM cannot capture for "
            f"{model_type} models: use ids >= 1, or extract.backend: hf"
        )


@dataclass(frozen=True)
class ExtractionEngine:
    """What vLLM's extraction engine is built from, resolved once by the stage that starts it:
    the verifier's facts, the vllm section, and the caller's token budget per batch and seed."""

    verifier: VerifierFacts
    vllm: VllmParams
    max_tokens_per_batch: int
    seed: int


def engine_kwargs(e: ExtractionEngine, layer_ids: list[int], storage_dir: Path) -> dict[str, Any]:
    """Arguments of vllm.LLM for extraction; vllm.extra_args may override all but `required`.

    Prefix caching stays off whatever extra_args say: a cached prefix is not recomputed, so its
    hidden states would be missing from the file. Chunked prefill stays as vLLM sets it (on): the
    connector gathers a request's hidden states from its cache blocks when the request finishes
    (`get_finished`), whatever chunks computed them, and vLLM warns against turning it off.
    """
    ordered, _ = vllm_layer_order(layer_ids)
    v = e.vllm
    check_layer_ids(e.verifier.model_type, layer_ids)
    defaults = model_args(e.verifier, v, dtype=engine_dtype(e.verifier)) | {
        "max_num_batched_tokens": max(v.max_model_len, e.max_tokens_per_batch),
        "seed": e.seed,
    }
    required = {
        "enable_prefix_caching": False,
        "speculative_config": {
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": ordered}},
        },
        "kv_transfer_config": connector_config(storage_dir),
    }
    return defaults | in_process.engine_overrides(v.extra_args, "extract") | required


def check_prompt_lengths(lengths: dict[str, int], max_model_len: int) -> None:
    """Refuse before starting vLLM: a prompt needs room for the one output token."""
    too_long = {sid: n for sid, n in lengths.items() if n > max_model_len - 1}
    if too_long:
        sid = max(too_long, key=too_long.__getitem__)
        raise DataError(
            f"sample {sid} has {too_long[sid]} tokens; vLLM takes at most vllm.max_model_len - 1 "
            f"= {max_model_len - 1}: raise vllm.max_model_len or lower tokenize.max_seq_len"
        )


def _hidden_states_path(output) -> str:
    path = (output.kv_transfer_params or {}).get("hidden_states_path")
    if not path:
        raise VerifierError(
            "vLLM returned no hidden_states_path: its KV connector did not run; see the vLLM log "
            "above this line"
        )
    return path


def write_failure(path: str) -> OSError | None:
    """The connector's failed write of `path` (its `.failed-<errno>` marker), if any."""
    for marker in glob.glob(glob.escape(path) + FAILED_SUFFIX + "*"):
        code = int(marker.rsplit("-", 1)[1])
        return OSError(code, os.strerror(code), path)
    return None


def _written(path: str) -> bool:
    """The file exists and its writer released the `.lock` beside it (stock protocol)."""
    if not os.path.exists(path):
        return False
    try:
        fd = os.open(path + ".lock", os.O_RDONLY)
    except FileNotFoundError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


class HiddenStateEngine:
    """One vLLM engine; `extract` returns [seq, n_ids, hidden] per prompt, in `layer_ids` order."""

    def __init__(self, kwargs: dict[str, Any], v: VllmParams, layer_ids: list[int]) -> None:
        """`kwargs`: engine_kwargs' (the connector's folder in them already emptied)."""
        from vllm import SamplingParams

        self.write_timeout_s = v.ready_timeout_s
        self.max_model_len = v.max_model_len
        self._order = vllm_layer_order(layer_ids)[1]
        self._sampling = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
        log("extract", f"starting vLLM (extract_hidden_states, layer ids {layer_ids})")
        self.llm = in_process.start(kwargs, kwargs["model"])

    def extract(self, prompts: list[list[int]]) -> list[torch.Tensor]:
        """Hidden states of each prompt's tokens, read from the connector's files."""
        check_prompt_lengths({str(i): len(p) for i, p in enumerate(prompts)}, self.max_model_len)
        requests = [{"prompt_token_ids": p} for p in prompts]
        outputs = self.llm.generate(requests, self._sampling, use_tqdm=False)
        paths = [_hidden_states_path(out) for out in outputs]
        self._wait_written(paths)
        return [self._read(path, p) for path, p in zip(paths, prompts, strict=True)]

    def _wait_written(self, paths: list[str]) -> None:
        """Step the engine until every file is written.

        The connector writes a request's file one or two engine steps AFTER the request
        finished. A server keeps stepping; an in-process engine only steps inside generate(),
        which has already returned, so waiting on the file's lock alone would wait forever.
        A failed write (disk full) raises the OS's error at once, not at the timeout.
        """
        deadline = time.monotonic() + self.write_timeout_s
        while not all(_written(p) for p in paths):
            for p in paths:
                if not _written(p) and (failed := write_failure(p)) is not None:
                    raise failed  # the OS's reason, now: extract adds the mount and free space
            if time.monotonic() > deadline:
                raise VerifierError(
                    f"vLLM did not write hidden states within {self.write_timeout_s:.0f} s "
                    f"(e.g. {paths[0]}): raise vllm.ready_timeout_s if the machine is busy"
                )
            self.llm.llm_engine.step()
            time.sleep(0.002)

    def _read(self, path: str, prompt: list[int]) -> torch.Tensor:
        data = load_file(path)
        for leftover in (path, path + ".lock"):
            Path(leftover).unlink(missing_ok=True)
        hidden, tokens = data["hidden_states"], data["token_ids"]
        if tokens.tolist() != prompt or hidden.shape[0] != len(prompt):
            raise VerifierError(
                f"vLLM wrote {hidden.shape[0]} hidden states for a {len(prompt)}-token prompt "
                "(or other token ids): prefix caching must stay off"
            )
        return hidden[:, self._order]

    def close(self) -> None:
        """Free the engine (tests start several in one process)."""
        del self.llm
        gc.collect()


def clear_dir(path: Path) -> None:
    """Empty the connector's folder: files of a killed run would collide with new request ids."""
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True, exist_ok=True)


@contextlib.contextmanager
def engine(
    e: ExtractionEngine, layer_ids: list[int], storage_dir: Path
) -> Iterator[HiddenStateEngine]:
    """An extraction engine (engine_kwargs) writing to `storage_dir`, removed on exit."""
    kwargs = engine_kwargs(e, layer_ids, storage_dir)
    clear_dir(storage_dir)
    eng = HiddenStateEngine(kwargs, e.vllm, layer_ids)
    try:
        yield eng
    finally:
        eng.close()
        shutil.rmtree(storage_dir, ignore_errors=True)


def hidden_state_spec(
    verifier: VerifierFacts,
    v: VllmParams,
    layer_ids: list[int],
    storage_dir: Path,
    log_file: Path,
) -> ServerSpec:
    """A server returning [seq, len(layer_ids), hidden] per request, layers in ascending order."""
    check_layer_ids(verifier.model_type, layer_ids)
    ordered, _ = vllm_layer_order(layer_ids)
    spec = verifier_spec(verifier, v, log_file, dtype=engine_dtype(verifier))
    # speculators' online dataloader asks for the model by the trainer's verifier path.
    spec.served_model_name = verifier.path
    spec.speculative_config = {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": ordered}},
    }
    spec.extra_args = [
        *spec.extra_args,
        "--no-enable-prefix-caching",
        "--kv-transfer-config",
        json.dumps(connector_config(storage_dir)),  # chosen where the server runs
    ]
    return spec
