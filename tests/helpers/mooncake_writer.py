"""The vLLM side of hs_connectors' `mooncake` backend, played on CPU: run as a separate process.

hs_connectors' MooncakeHiddenStatesConnector needs an accelerator (streams, events); this writer
does what it does around that, with the same calls: its store config is what
`MooncakeBackend.build_kv_transfer_config` hands vLLM (`--kv-transfer-config`), its manifest is
what `request_finished` returns to vLLM's response (`kv_transfer_params`), and it publishes
with `assert_finite` + `put_sample`, or `put_error` when that refuses (`_write_sample`).

    python mooncake_writer.py MASTER OUT_DIR

Writes the cases below, saves the tensors it sent to OUT_DIR/sent.safetensors, prints one JSON
line {case: kv_transfer_params}, then holds its Mooncake segment (objects may live in it) until
its stdin closes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from hs_connectors import MooncakeBackend
from hs_connectors.mooncake_store import (
    VERSION,
    MooncakeHiddenStatesStore,
    MooncakeStoreConfig,
    assert_finite,
    packed_layout,
)
from safetensors.torch import save_file

NUM_TOKENS, NUM_LAYERS, HIDDEN = 7, 4, 64  # 3 aux layers + the final one, like the pipeline's
SEGMENT_GIB, BUFFER_GIB = 1 / 16, 1 / 32  # 64 MiB registered, 32 MiB staging


def kv_transfer_config(master: str) -> dict:
    """What `--kv-transfer-config` gets on the vLLM machine (hs_connectors builds it)."""
    parser = argparse.ArgumentParser()
    MooncakeBackend.add_launch_args(parser)
    args = parser.parse_args(
        [
            f"--mooncake-master={master}",
            f"--mooncake-global-segment-gib={SEGMENT_GIB}",
            f"--mooncake-local-buffer-gib={BUFFER_GIB}",
            "--mooncake-writer-threads=1",
        ]
    )
    return MooncakeBackend.build_kv_transfer_config(args)


def manifest(handle: str, token_ids: torch.Tensor, dtype: torch.dtype) -> dict:
    """The connector's request_finished: the packed layout of one prompt's hidden states."""
    num_tokens = token_ids.numel()
    tensors, total_bytes = packed_layout(
        {
            "hidden_states": ([num_tokens, NUM_LAYERS, HIDDEN], dtype),
            "token_ids": (list(token_ids.shape), token_ids.dtype),
        }
    )
    return {
        "handle": handle,
        "version": VERSION,
        "tensors": tensors,
        "metadata": {
            "num_tokens": num_tokens,
            "total_aligned_bytes": total_bytes,
            "extract_mode": "prompt_only",
        },
    }


def write_like_the_connector(store: MooncakeHiddenStatesStore, m: dict, tensors: dict) -> None:
    """The connector's _write_sample after the device copy."""
    try:
        assert_finite("hidden_states", tensors["hidden_states"])
        store.put_sample(m, tensors)
    except Exception as exc:  # the connector publishes the refusal for the consumer
        store.put_error(m, str(exc))


def main() -> int:
    master, out_dir = sys.argv[1], Path(sys.argv[2])
    config = kv_transfer_config(master)
    store = MooncakeHiddenStatesStore(
        MooncakeStoreConfig.from_dict(config["kv_connector_extra_config"]["mooncake"])
    ).setup()

    gen = torch.Generator().manual_seed(0)
    token_ids = torch.randint(0, 32000, (NUM_TOKENS,), generator=gen)  # int64, as vLLM's
    hidden = torch.randn(NUM_TOKENS, NUM_LAYERS, HIDDEN, generator=gen).to(torch.bfloat16)
    with_nan = hidden.clone()
    with_nan[3, 1, 5] = float("nan")
    sent = {"hidden_states": hidden, "token_ids": token_ids}

    params = {}
    # A sample as vLLM publishes it.
    params["good"] = m = manifest("cmpl-good-0", token_ids, torch.bfloat16)
    write_like_the_connector(store, m, sent)
    # NaN in the forward pass: the connector refuses it and publishes an error marker.
    params["nan_refused"] = m = manifest("cmpl-nan-refused-0", token_ids, torch.bfloat16)
    write_like_the_connector(store, m, {"hidden_states": with_nan, "token_ids": token_ids})
    # NaN that got past the producer (a writer without the check): stored as it is.
    params["nan_stored"] = m = manifest("cmpl-nan-stored-0", token_ids, torch.bfloat16)
    store.put_sample(m, {"hidden_states": with_nan, "token_ids": token_ids})
    # A truncated object: fewer bytes under the key than the manifest describes.
    params["truncated"] = m = manifest("cmpl-truncated-0", token_ids, torch.bfloat16)
    payload = bytes(m["metadata"]["total_aligned_bytes"] // 2)
    result = store._require_store().put(m["handle"], payload)
    assert result == 0, f"put of the truncated object returned {result}"
    # Never written.
    params["missing"] = manifest("cmpl-missing-0", token_ids, torch.bfloat16)

    save_file(sent, str(out_dir / "sent.safetensors"))
    # vLLM's response carries the manifest as JSON (`kv_transfer_params`).
    print(json.dumps({"kv_transfer_config": config, "params": params}), flush=True)
    sys.stdin.read()  # hold the segment until the test is done
    store._require_store().close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
