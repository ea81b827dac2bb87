"""The verifier served by vLLM with `extract_hidden_states`: what online training asks.

The same engine settings as extract's in-process engine (serving/hidden_states.py): the
verifier's own dtype, layer ids in vLLM's ascending order, prefix caching off (a cached prefix is
not recomputed, so its hidden states would be missing) and our connector, which writes one
safetensors file per request to `storage_dir` and reports the file in the response's
`kv_transfer_params`. speculators' online dataloader sends each sample's token ids with
`max_tokens=1` and reads that file back (hs_connectors' `file` backend).
"""

from __future__ import annotations

import json
from pathlib import Path

from eagle3_pipeline.config.params import VllmParams
from eagle3_pipeline.serving.hidden_states import (
    check_layer_ids,
    connector_config,
    vllm_layer_order,
)
from eagle3_pipeline.serving.server import ServerSpec
from eagle3_pipeline.serving.server_spec import engine_dtype, verifier_spec
from eagle3_pipeline.verifier.identity import VerifierFacts


def hidden_state_spec(
    verifier: VerifierFacts,
    v: VllmParams,
    layer_ids: list[int],
    storage_dir: Path,
    log_file: Path,
) -> ServerSpec:
    """A server returning [seq, len(layer_ids), hidden] per request, layers in ascending order."""
    check_layer_ids(verifier.config, layer_ids)
    ordered, _ = vllm_layer_order(layer_ids)
    spec = verifier_spec(verifier, v, log_file, dtype=engine_dtype(verifier.config))
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
