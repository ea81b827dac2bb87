"""Hidden states from vLLM itself: an in-process engine with `extract_hidden_states`.

vLLM's `extract_hidden_states` speculative method stores, for every prompt token, the residual
stream at `eagle_aux_hidden_state_layer_ids` in a cache that a KV connector writes to one
safetensors file per request (`hidden_states [seq, n_ids, hidden]`, `token_ids [seq]`). We run
each prompt for one output token, read the file back and delete it; the caller writes the store.

Layer ids: vLLM collects id i after decoder layer i-1 (`hidden_states + residual`, i.e. the input
of layer i; id 0 = the embeddings) and id N after the last layer, before the final norm. That is
the project's convention (layers.py), so ids pass through unchanged. The only translation is the
ORDER: vLLM collects layers in ascending order whatever order they were listed in, so
`vllm_layer_order` asks for them sorted and `HiddenStateEngine` permutes the result back.
"""

from __future__ import annotations

import contextlib
import gc
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from eagle3_pipeline.errors import DataError, VerifierError
from eagle3_pipeline.params import Params
from eagle3_pipeline.progress import log
from eagle3_pipeline.vllm_server import server_env

CPU_CONNECTOR = "CPUHiddenStatesConnector"
CPU_CONNECTOR_MODULE = "eagle3_pipeline.cpu_hs_connector"
GPU_CONNECTOR = "ExampleHiddenStatesConnector"
_VLLM_DTYPES = {"float32", "bfloat16", "float16"}


def vllm_layer_order(layer_ids: list[int]) -> tuple[list[int], list[int]]:
    """(ids in the order vLLM returns them, index of each of our ids in that order)."""
    ordered = sorted(layer_ids)
    return ordered, [ordered.index(i) for i in layer_ids]


def engine_dtype(config: dict[str, Any]) -> str:
    """The verifier's own dtype, as the hf backend loads it.

    vLLM's "auto" downcasts a float32 checkpoint to bf16; the two backends would then compute
    different tensors (DESIGN: they must agree).
    """
    from eagle3_pipeline import verifier as vf

    dtype = str(vf.text_config(config).get("dtype") or config.get("torch_dtype") or "auto")
    return dtype if dtype in _VLLM_DTYPES else "auto"


def connector_config(storage_dir: Path) -> dict[str, Any]:
    """Stock connector on GPU; on CPU ours (the stock one pins memory and kills the engine)."""
    config: dict[str, Any] = {
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": str(storage_dir.resolve())},
    }
    if torch.cuda.is_available():
        return config | {"kv_connector": GPU_CONNECTOR}
    return config | {
        "kv_connector": CPU_CONNECTOR,
        "kv_connector_module_path": CPU_CONNECTOR_MODULE,
    }


def engine_overrides(extra_args: list[str]) -> dict[str, Any]:
    """Engine arguments among params.vllm.extra_args (server-only flags are skipped)."""
    if not extra_args:
        return {}
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    defaults = vars(parser.parse_known_args([])[0])
    given, unknown = parser.parse_known_args(extra_args)
    if unknown:
        log("extract", f"vllm.extra_args not used by the in-process engine: {unknown}")
    return {k: v for k, v in vars(given).items() if v != defaults.get(k)}


def engine_kwargs(params: Params, layer_ids: list[int], storage_dir: Path) -> dict[str, Any]:
    """Arguments of vllm.LLM for extraction.

    Prefix caching and chunked prefill are off: a cached or chunked prefix is not recomputed, so
    its hidden states would be missing from the file.
    """
    from eagle3_pipeline import verifier as vf

    v = params.vllm
    ordered, _ = vllm_layer_order(layer_ids)
    hf_config = {"eagle_aux_hidden_state_layer_ids": ordered}
    return {
        "model": params.verifier.path,
        "revision": params.verifier.revision,
        "trust_remote_code": params.verifier.trust_remote_code,
        "dtype": engine_dtype(vf.read_config(params.verifier.path)),
        "max_model_len": v.max_model_len,
        "max_num_batched_tokens": max(v.max_model_len, params.extract.max_tokens_per_batch),
        "enforce_eager": v.enforce_eager,
        "tensor_parallel_size": v.tensor_parallel_size,
        "enable_prefix_caching": False,
        "enable_chunked_prefill": False,
        "speculative_config": {
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": hf_config},
        },
        "kv_transfer_config": connector_config(storage_dir),
        "seed": params.seed,
    } | engine_overrides(v.extra_args)


def _set_env() -> None:
    """In-process engine core (no extra process), offline, caches inside the workspace."""
    os.environ.update(server_env({"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}))


class HiddenStateEngine:
    """One vLLM engine; `extract` returns [seq, n_ids, hidden] per prompt, in `layer_ids` order."""

    def __init__(self, params: Params, layer_ids: list[int], storage_dir: Path) -> None:
        _set_env()
        from vllm import LLM, SamplingParams

        self.storage_dir = storage_dir
        self.max_prompt_len = params.vllm.max_model_len - 1  # room for the one output token
        self._order = vllm_layer_order(layer_ids)[1]
        self._sampling = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
        clear_dir(storage_dir)
        log("extract", f"starting vLLM (extract_hidden_states, layer ids {layer_ids})")
        self.llm = LLM(**engine_kwargs(params, layer_ids, storage_dir))

    def extract(self, prompts: list[list[int]]) -> list[torch.Tensor]:
        """Hidden states of each prompt's tokens, read from the connector's files."""
        too_long = [len(p) for p in prompts if len(p) > self.max_prompt_len]
        if too_long:
            raise DataError(
                f"a sample has {max(too_long)} tokens; vLLM needs at most "
                f"vllm.max_model_len - 1 = {self.max_prompt_len}: raise vllm.max_model_len"
            )
        requests = [{"prompt_token_ids": p} for p in prompts]
        outputs = self.llm.generate(requests, self._sampling, use_tqdm=False)
        return [self._read(out, p) for out, p in zip(outputs, prompts, strict=True)]

    def _read(self, output, prompt: list[int]) -> torch.Tensor:
        from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
            cleanup_hidden_states,
            load_hidden_states,
        )

        path = (output.kv_transfer_params or {}).get("hidden_states_path")
        if not path:
            raise VerifierError(
                "vLLM returned no hidden_states_path: the KV connector did not run (check "
                "vllm.extra_args for a kv-transfer-config that replaces ours)"
            )
        data = load_hidden_states(path)
        cleanup_hidden_states(path)
        hidden, tokens = data["hidden_states"], data["token_ids"]
        if tokens.tolist() != prompt or hidden.shape[0] != len(prompt):
            raise VerifierError(
                f"vLLM wrote {hidden.shape[0]} hidden states for a {len(prompt)}-token prompt "
                "(or other token ids): prefix caching or chunked prefill must stay off"
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
def engine(params: Params, layer_ids: list[int], storage_dir: Path) -> Iterator[HiddenStateEngine]:
    eng = HiddenStateEngine(params, layer_ids, storage_dir)
    try:
        yield eng
    finally:
        eng.close()
        clear_dir(storage_dir)
