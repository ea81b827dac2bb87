"""How the verifier's hidden states are computed, for the extract stage and the layer probe.

Batches are bounded by a token budget (padded tokens), never by a sample count: one long sample
must not OOM a batch sized for short ones; samples are length-sorted so padding stays small.
Backends differ only in how a batch is computed: `hf` runs the transformers model with forward
hooks (verifier/capture.py), `vllm` asks vLLM's `extract_hidden_states` method
(serving/hidden_states.py). Both return [seq, n_ids, hidden] per sample, in layer-id order.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from eagle3_pipeline.core import paths
from eagle3_pipeline.core.errors import DataError
from eagle3_pipeline.verifier import loading
from eagle3_pipeline.verifier.capture import LayerCapture, forward_hidden_states
from eagle3_pipeline.verifier.identity import VerifierFacts

if TYPE_CHECKING:
    import torch

    from eagle3_pipeline.serving.hidden_states import ExtractionEngine

# A batch of token id lists -> one [seq, n_ids, hidden] tensor per sample, in layer-id order.
BatchFn = Callable[[list[list[int]]], "list[torch.Tensor]"]


def token_budget_batches(lengths: dict[str, int], max_tokens: int) -> list[list[str]]:
    """Length-sorted batches whose padded size (n x longest) stays within max_tokens."""
    order = sorted(lengths, key=lambda i: (lengths[i], i))
    batches: list[list[str]] = []
    cur: list[str] = []
    for sid in order:
        if lengths[sid] > max_tokens:
            raise DataError(
                f"{paths.TOKENIZED}: sample {sid} has {lengths[sid]} tokens, more than "
                f"extract.max_tokens_per_batch={max_tokens}: raise it or lower tokenize.max_seq_len"
            )
        if cur and (len(cur) + 1) * lengths[sid] > max_tokens:
            batches.append(cur)
            cur = []
        cur.append(sid)
    if cur:
        batches.append(cur)
    return batches


@contextlib.contextmanager
def hf_backend(verifier: VerifierFacts, layer_ids: list[int]) -> Iterator[BatchFn]:
    """transformers forward with hooks; right-padded batches, padding cut off per sample."""

    model = loading.load_model(verifier)
    capture = LayerCapture(model, layer_ids)

    def run_batch(batch_ids: list[list[int]]) -> list[torch.Tensor]:
        hs = forward_hidden_states(model, capture, batch_ids)
        return [hs[j, : len(ids)] for j, ids in enumerate(batch_ids)]

    try:
        yield run_batch
    finally:
        capture.remove()


@contextlib.contextmanager
def vllm_backend(e: ExtractionEngine, layer_ids: list[int], work: Path) -> Iterator[BatchFn]:
    """vLLM's extract_hidden_states; its connector writes into `work`."""
    from eagle3_pipeline.serving import hidden_states as vllm_extract

    with vllm_extract.engine(e, layer_ids, work) as eng:
        yield eng.extract


def open_backend(
    backend: str, e: ExtractionEngine, layer_ids: list[int], work: Path
) -> contextlib.AbstractContextManager[BatchFn]:
    """extract.backend `backend`'s batch function (`e`: the verifier's facts, and the vLLM
    engine's settings where the backend is vllm)."""
    if backend == "vllm":
        return vllm_backend(e, layer_ids, work)
    return hf_backend(e.verifier, layer_ids)
