"""Stage `extract`: the verifier's aux and final hidden states for every tokenized sample.

Batches are bounded by a token budget (padded tokens), never by a sample count: one long sample
must not OOM a batch sized for short ones. Samples are length-sorted so padding stays small.
Finished files accumulate in data/.work/extract/ (journaled per batch) and move into
data/hidden_states/ by rename once all are done: a killed run redoes at most one batch.

Backends (extract.backend) differ only in how a batch's hidden states are computed: `hf` runs the
transformers model with hooks (LayerCapture), `vllm` asks vLLM's `extract_hidden_states` method
(vllm_extract.py). Both hand [seq, n_ids, hidden] per sample to the same store writer.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from eagle3_pipeline import atomic, resume, store
from eagle3_pipeline import verifier as vf
from eagle3_pipeline.errors import DataError
from eagle3_pipeline.layers import resolve_layer_ids
from eagle3_pipeline.params import Params
from eagle3_pipeline.progress import Progress, log

if TYPE_CHECKING:
    import torch

STAGE = "extract"
INPUT_DIR = Path("data/tokenized")
OUTPUT_DIR = Path("data/hidden_states")
VLLM_FILES = "vllm"  # subfolder of the scratch dir where vLLM's connector writes its files

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
                f"{INPUT_DIR}: sample {sid} has {lengths[sid]} tokens, more than "
                f"extract.max_tokens_per_batch={max_tokens}: raise it or lower tokenize.max_seq_len"
            )
        if cur and (len(cur) + 1) * lengths[sid] > max_tokens:
            batches.append(cur)
            cur = []
        cur.append(sid)
    if cur:
        batches.append(cur)
    return batches


class LayerCapture:
    """Forward hooks that record the residual stream at the requested layer ids.

    Id k < N: the input of decoder layer k. Id N: the output of decoder layer N-1, which is the
    stream BEFORE the final norm (transformers' hidden_states[N] is after it).
    """

    def __init__(self, model, layer_ids: list[int]) -> None:
        import torch

        self._torch = torch
        self.layers = vf.decoder_layers(model)
        self.layer_ids = layer_ids
        self.captured: dict[int, torch.Tensor] = {}
        self._handles = []
        n = len(self.layers)
        for lid in layer_ids:
            if lid < n:
                self._handles.append(
                    self.layers[lid].register_forward_pre_hook(self._pre(lid), with_kwargs=True)
                )
            else:
                self._handles.append(self.layers[n - 1].register_forward_hook(self._post(lid)))

    def _pre(self, lid: int):
        def hook(_module, args, kwargs):
            hs = args[0] if args else kwargs["hidden_states"]
            self.captured[lid] = hs.detach()

        return hook

    def _post(self, lid: int):
        def hook(_module, _args, output):
            hs = output[0] if isinstance(output, tuple) else output
            self.captured[lid] = hs.detach()

        return hook

    def stacked(self):
        """[batch, seq, n_ids, hidden] in layer_ids order."""
        return self._torch.stack([self.captured[i] for i in self.layer_ids], dim=2)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def forward_hidden_states(model, capture: LayerCapture, batch_ids: list[list[int]]):
    """Run one right-padded batch; return [batch, max_len, n_ids, hidden]."""
    import torch

    max_len = max(len(x) for x in batch_ids)
    input_ids = torch.zeros(len(batch_ids), max_len, dtype=torch.long)
    mask = torch.zeros(len(batch_ids), max_len, dtype=torch.long)
    for i, ids in enumerate(batch_ids):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        mask[i, : len(ids)] = 1
    capture.captured.clear()
    with torch.no_grad():
        base = getattr(model, "model", model)  # skip lm_head: only hidden states are needed
        base(input_ids=input_ids, attention_mask=mask, use_cache=False)
    return capture.stacked()


@contextlib.contextmanager
def hf_backend(params: Params, layer_ids: list[int]) -> Iterator[BatchFn]:
    """transformers forward with hooks; right-padded batches, padding cut off per sample."""

    model = vf.load_model(params)
    capture = LayerCapture(model, layer_ids)

    def run_batch(batch_ids: list[list[int]]) -> list[torch.Tensor]:
        hs = forward_hidden_states(model, capture, batch_ids)
        return [hs[j, : len(ids)] for j, ids in enumerate(batch_ids)]

    try:
        yield run_batch
    finally:
        capture.remove()


@contextlib.contextmanager
def vllm_backend(params: Params, layer_ids: list[int], work: Path) -> Iterator[BatchFn]:
    """vLLM's extract_hidden_states; its connector writes into the scratch dir."""
    from eagle3_pipeline import vllm_extract

    with vllm_extract.engine(params, layer_ids, work / VLLM_FILES) as eng:
        yield eng.extract


def open_backend(
    params: Params, layer_ids: list[int], work: Path
) -> contextlib.AbstractContextManager[BatchFn]:
    if params.extract.backend == "vllm":
        return vllm_backend(params, layer_ids, work)
    return hf_backend(params, layer_ids)


def write_batch(
    work: Path, batch_rows: list[dict], states: list[torch.Tensor], layout: store.StoreLayout
) -> list[dict]:
    """Store one batch's samples in the scratch dir; return their journal entries."""
    import torch

    entries = []
    for row, hs in zip(batch_rows, states, strict=True):
        entry = store.write_sample(
            work,
            row["id"],
            hs,
            torch.tensor(row["input_ids"]),
            torch.tensor(row["loss_mask"]),
            layout,
        )
        entries.append(entry | {"id": row["id"], "split": row["split"]})
    return entries


def run(params: Params) -> None:
    config = vf.read_config(params.verifier.path)
    n_layers, hidden, _ = vf.shape(config)
    aux, final = resolve_layer_ids(params.layers, n_layers)
    rows = {
        r["id"]: r
        for split in ("train", "val")
        for r in atomic.read_jsonl(INPUT_DIR / f"{split}.jsonl")
    }
    layout = store.StoreLayout(aux, final, hidden, params.extract.store_dtype, vf.identity(params))
    key = resume.fingerprint(
        layout.__dict__,
        vf.files_stamp(params.verifier.path),
        params.extract.model_dump(),
        resume.file_sha256(INPUT_DIR / "train.jsonl"),
        resume.file_sha256(INPUT_DIR / "val.jsonl"),
    )
    work = resume.scratch_dir(STAGE, key)
    journal = resume.Journal(work / "entries.jsonl")
    entries = {e["id"]: e for e in journal.read() if (work / e["file"]).exists()}
    batches = token_budget_batches(
        {i: len(r["input_ids"]) for i, r in rows.items()}, params.extract.max_tokens_per_batch
    )
    todo = [b for b in batches if not all(i in entries for i in b)]
    total_tokens = sum(len(r["input_ids"]) for r in rows.values())
    done_tokens = total_tokens - sum(len(rows[i]["input_ids"]) for b in todo for i in b)
    progress = Progress(STAGE, total_tokens, unit="tok", already_done=done_tokens)
    if params.extract.backend == "vllm":  # refuse before the engine's slow start
        from eagle3_pipeline.vllm_extract import check_prompt_lengths

        check_prompt_lengths(
            {i: len(rows[i]["input_ids"]) for b in todo for i in b}, params.vllm.max_model_len
        )
    padded = real = 0
    if todo:
        with open_backend(params, layout.layer_ids, work) as run_batch:
            for batch in todo:
                ids = [rows[i]["input_ids"] for i in batch]
                new = write_batch(work, [rows[i] for i in batch], run_batch(ids), layout)
                journal.append(new)
                entries.update({e["id"]: e for e in new})
                progress.advance(sum(len(x) for x in ids))
                padded += len(ids) * max(len(x) for x in ids)
                real += sum(len(x) for x in ids)
    with atomic.replace_dir(OUTPUT_DIR) as tmp:
        for sid in rows:
            os.replace(work / entries[sid]["file"], tmp / entries[sid]["file"])
        store.write_manifest(
            tmp, layout, {sid: {k: v for k, v in entries[sid].items() if k != "id"} for sid in rows}
        )
    journal.clear()
    gb = total_tokens * layout.bytes_per_token() / 1e9
    log(
        STAGE,
        f"{len(rows)} samples, {total_tokens:,} tokens, layers {layout.layer_ids}, "
        f"{gb:.3f} GB, {_padding_note(params.extract.backend, real, padded)} -> {OUTPUT_DIR}",
    )


def _padding_note(backend: str, real: int, padded: int) -> str:
    """hf pads each batch to its longest sample; vLLM packs sequences without padding."""
    if backend == "vllm":
        return "backend vllm (no padding)"
    return f"padding {1 - real / padded if padded else 0.0:.1%}"
