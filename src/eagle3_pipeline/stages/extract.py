"""Stage `extract`: the verifier's aux and final hidden states for every tokenized sample.

Batches are bounded by a token budget (padded tokens), never by a sample count: one long sample
must not OOM a batch sized for short ones. Samples are length-sorted so padding stays small.
Finished files accumulate in data/.work/extract/ (journaled per batch) and move into
data/hidden_states/ by rename once all are done: a killed run redoes at most one batch.
"""

from __future__ import annotations

import os
from pathlib import Path

from eagle3_pipeline import atomic, resume, store
from eagle3_pipeline import verifier as vf
from eagle3_pipeline.errors import DataError
from eagle3_pipeline.layers import resolve_layer_ids
from eagle3_pipeline.params import Params
from eagle3_pipeline.progress import Progress, log

STAGE = "extract"
INPUT_DIR = Path("data/tokenized")
OUTPUT_DIR = Path("data/hidden_states")


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


def run(params: Params) -> None:
    import torch

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
    padded = real = 0
    if todo:
        model = vf.load_model(params)
        capture = LayerCapture(model, layout.layer_ids)
        torch.set_grad_enabled(False)
        for batch in todo:
            ids = [rows[i]["input_ids"] for i in batch]
            hs = forward_hidden_states(model, capture, ids)
            padded += hs.shape[0] * hs.shape[1]
            new = []
            for j, sid in enumerate(batch):
                n = len(ids[j])
                entry = store.write_sample(
                    work,
                    sid,
                    hs[j, :n],
                    torch.tensor(ids[j]),
                    torch.tensor(rows[sid]["loss_mask"]),
                    layout,
                )
                new.append(entry | {"id": sid, "split": rows[sid]["split"]})
                real += n
            journal.append(new)
            entries.update({e["id"]: e for e in new})
            progress.advance(sum(len(x) for x in ids))
        capture.remove()
    with atomic.replace_dir(OUTPUT_DIR) as tmp:
        for sid in rows:
            os.replace(work / entries[sid]["file"], tmp / entries[sid]["file"])
        store.write_manifest(
            tmp, layout, {sid: {k: v for k, v in entries[sid].items() if k != "id"} for sid in rows}
        )
    journal.clear()
    pad_frac = 1 - real / padded if padded else 0.0
    gb = total_tokens * layout.bytes_per_token() / 1e9
    log(
        STAGE,
        f"{len(rows)} samples, {total_tokens:,} tokens, layers {layout.layer_ids}, "
        f"{gb:.3f} GB, padding {pad_frac:.1%} -> {OUTPUT_DIR}",
    )
