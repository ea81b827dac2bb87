"""Stage `extract`: the verifier's aux and final hidden states for every tokenized sample.

Batches are bounded by a token budget (padded tokens), never by a sample count: one long sample
must not OOM a batch sized for short ones. Samples are length-sorted so padding stays small.
Finished files accumulate in data/.work/extract/ (journaled per batch) and move into
data/hidden_states/ by rename once all are done. Batch n is written while the verifier computes
batch n+1, so the engine never waits for the disk; a killed run redoes at most those two batches,
and every file it reuses is re-hashed first (a damaged one is extracted again, never published).

`--shard i/n` extracts batches i, i+n, ... of the same plan into the same scratch folder (shared
storage across nodes), each worker with its own journal; a plain run then reuses every shard's
intact files, extracts whatever is still missing and publishes one store and one manifest. Before
any work, a pre-flight compares the bytes still to write with the free space of that disk, and
says whether scratch and store share a filesystem (publish by hardlink) or not (publish by copy,
fsynced; the store's disk must then hold it all). A write that fails anyway (disk full, in our
writer or in vLLM's connector) ends the stage at once with the OS's reason, the mount, its free
space and what is still to write (disk.py); the journal keeps what was complete.

Batching and the backends (extract.backend: `hf` hooks or vLLM's `extract_hidden_states`) are in
store/extraction.py, shared with `eagle3 probe-layers`; both backends hand [seq, n_ids, hidden] per
sample to the same store writer.

Grows by rows: each sample is keyed by its tokenized row (id, input_ids, loss_mask) and the
settings (`settings_key`: the layers, dtype and hidden size of the store, the backend, the
verifier's files, ROW_VERSION); the manifest records each sample's key (`row_key`). A sample
whose key is in the last published store (as DVC restores it: harness/published.py) keeps its
file, hardlinked into the new store (copied where DVC's cache copies); only the others are
planned into batches and extracted. The scratch folder is keyed on the settings alone, so a
killed run that grew resumes too. The batch budget is not part of a key: it decides which
samples share a batch, not what a sample is, so a sample's hidden states equal a run from
scratch's where the engine gives a sample the same values in any batch.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from eagle3_pipeline.config.layer_ids import store_aux_layer_ids
from eagle3_pipeline.config.params import Params
from eagle3_pipeline.core import atomic, disk, paths, readers, resume
from eagle3_pipeline.core.errors import StoreError
from eagle3_pipeline.core.progress import Progress, log
from eagle3_pipeline.harness import published
from eagle3_pipeline.serving.hidden_states import ExtractionEngine
from eagle3_pipeline.store import format as store
from eagle3_pipeline.store import names
from eagle3_pipeline.store.extraction import open_backend, token_budget_batches
from eagle3_pipeline.verifier import identity as vf

if TYPE_CHECKING:
    import torch

STAGE = "extract"
INPUT_DIR = paths.TOKENIZED
OUTPUT_DIR = paths.HIDDEN_STATES
VLLM_FILES = "vllm"  # subfolder of the scratch dir where vLLM's connector writes its files
JOURNAL = "entries.jsonl"  # the unsharded run's journal; shards write entries.shard-I-of-N.jsonl
# Bump when the code that makes a sample's file changes what it holds: every sample is made again.
ROW_VERSION = 1
# Not what a sample's file holds: how much room to keep, which val rows online mode keeps, how
# samples are batched.
_NOT_KEYED = {"disk_headroom_gb", "online_keep_val", "max_tokens_per_batch"}


def write_batch(
    work: Path,
    batch_rows: list[dict],
    states: list[torch.Tensor],
    layout: store.StoreLayout,
    skip: set[str] | frozenset[str] = frozenset(),
) -> list[dict]:
    """Store one batch's samples (except those in `skip`) in the scratch dir; journal entries."""
    import torch

    todo = [(r, hs) for r, hs in zip(batch_rows, states, strict=True) if r["id"] not in skip]
    written = store.write_samples(
        work,
        [
            (r["id"], hs, torch.tensor(r["input_ids"]), torch.tensor(r["loss_mask"]))
            for r, hs in todo
        ],
        layout,
    )
    return [
        e | {"id": r["id"], "split": r["split"], "row_key": r["row_key"]}
        for (r, _), e in zip(todo, written, strict=True)
    ]


def online_rows(rows: dict[str, dict], keep_val: int | None) -> dict[str, dict]:
    """Online mode's store: the val rows only, the first `keep_val` by id (None: all)."""
    val = sorted(i for i, r in rows.items() if r["split"] == "val")[:keep_val]
    if not val:
        raise StoreError(f"{INPUT_DIR}/val.jsonl: no val samples: raise prepare.val_ratio")
    return {i: rows[i] for i in val}


def shard_batches(batches: list[list[str]], shard: tuple[int, int] | None) -> list[list[str]]:
    """Shard i of n owns batches i, i+n, i+2n, ... of the length-sorted plan of ALL samples.

    Whole batches, not single ids: a sample's hidden states then come from exactly the batch an
    unsharded run would put it in (same padding, same kernels), so n shards merge into the same
    bytes as one run. Round-robin over length-sorted batches also gives each shard a similar
    token count. Disjoint by construction; the plan depends only on ids and lengths.
    """
    if shard is None:
        return batches
    i, n = shard
    return batches[i::n]


def journal_name(shard: tuple[int, int] | None) -> str:
    """One journal per worker, so that shards on many nodes never append to the same file."""
    return JOURNAL if shard is None else f"entries.shard-{shard[0]}-of-{shard[1]}.jsonl"


def settings_key(params: Params, layout: store.StoreLayout, verifier_stamp: str) -> str:
    """What decides every sample's file besides its tokenized row: the store's layers, dtype and
    hidden size, the extract params that shape a file, the engine's settings (backend vllm), the
    verifier's files (`VerifierFacts.stamp`: the same on every machine) and ROW_VERSION."""
    engine = (
        params.vllm.model_dump(exclude={"ready_timeout_s", "gpu_memory_gib", "max_model_len"})
        if params.extract.backend == "vllm"
        else None
    )
    return resume.fingerprint(
        STAGE,
        ROW_VERSION,
        {k: v for k, v in layout.__dict__.items() if k != "verifier"},  # names, not bytes
        params.extract.model_dump(exclude=_NOT_KEYED),
        engine,
        params.verifier.revision,
        verifier_stamp,
    )


def row_key(settings: str, row: dict) -> str:
    """One sample's key: the tokenized row it is made of."""
    return resume.row_key(settings, {k: row[k] for k in ("id", "input_ids", "loss_mask")})


def published_samples(
    keys: dict[str, str],
) -> tuple[published.Published | None, dict[str, dict]]:
    """The last published store, and its manifest entries by sample id of the samples whose key
    is `keys`' and whose file is there at its recorded size (re-hashed by train, not here: a
    store of 800 GB is read once, by its consumer)."""
    prev = published.previous(OUTPUT_DIR)
    manifest = prev.file(store.MANIFEST) if prev is not None else None
    if prev is None or manifest is None:
        return prev, {}
    try:
        samples = readers.read_json_object(manifest, StoreError, "").get("samples", {})
    except StoreError:
        log(STAGE, f"{prev.where}: its {store.MANIFEST} is unreadable: nothing reused from it")
        return prev, {}
    found = {}
    for sid, e in samples.items():
        if sid not in keys or e.get("row_key") != keys[sid]:
            continue
        path = prev.file(e["file"])
        if path is not None and path.stat().st_size == e["bytes"]:
            found[sid] = e
    return prev, found


def reusable_entries(work: Path, wanted: dict[str, str]) -> dict[str, dict]:
    """Journaled samples (of any worker) of the keys `wanted` (id -> row key) whose scratch file
    is intact; the others are deleted.

    Re-hashes each file it would reuse: a file truncated or damaged after it was journaled
    (disk full, a bad node, a copy gone wrong) is extracted again, never moved into the store.
    """
    candidates: dict[str, list[dict]] = {}
    for path in sorted(work.glob("entries*.jsonl")):
        for e in resume.Journal(path).read():
            if e["id"] in wanted and e.get("row_key") == wanted[e["id"]]:
                candidates.setdefault(e["id"], []).append(e)
    present = {sid: work / es[-1]["file"] for sid, es in candidates.items()}
    present = {sid: p for sid, p in present.items() if p.is_file()}
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:  # hashlib drops the GIL
        digests = dict(zip(present, pool.map(resume.file_sha256, present.values()), strict=True))
    good: dict[str, dict] = {}
    for sid, path in sorted(present.items()):
        match = [e for e in candidates[sid] if e["sha256"] == digests[sid]]
        if match:
            good[sid] = match[-1]
        else:
            log(STAGE, f"{path}: does not match its journal entry (damaged?): extracting it again")
            path.unlink()
    return good


def preflight(
    work: Path, num_tokens: int, store_tokens: int, layout: store.StoreLayout, headroom_gb: float
) -> str:
    """Refuse to start when a filesystem cannot hold what is left to write; say the layout.

    Scratch and output on one filesystem: publishing hardlinks, so only the tokens still to
    extract need room. On two (scratch on local NVMe, the store on shared storage): publishing
    copies the whole store to the output's filesystem, which must hold it too.
    """
    if os.path.ismount(OUTPUT_DIR):
        raise StoreError(
            f"{OUTPUT_DIR} is a mount point, but the store is replaced whole by a rename beside "
            f"it: mount that filesystem at {OUTPUT_DIR.parent} (or above) instead"
        )
    per = layout.file_bytes_per_token()
    needs = [(work, num_tokens, f"{num_tokens:,} tokens")]
    if not disk.same_filesystem(work, OUTPUT_DIR.parent):
        needs.append(
            (OUTPUT_DIR.parent, store_tokens, f"the whole store, {store_tokens:,} tokens,")
        )
    for where, tokens, what in needs:
        need = tokens * per + headroom_gb * 1e9
        free = shutil.disk_usage(disk.existing(where)).free
        if tokens and need > free:
            raise StoreError(
                f"{where}: extract needs {need / 1e9:,.1f} GB ({what} x {per:,} B/token + "
                f"extract.disk_headroom_gb={headroom_gb:g}) but the disk has {free / 1e9:,.1f} GB "
                "free: free space, put data/ on a larger disk, or set extract.store_dtype: fp8 "
                "(about half the bytes)"
            )
    return disk.layout(work, OUTPUT_DIR)


def padding_fraction(batches: list[list[str]], lengths: dict[str, int]) -> float:
    """Share of a right-padded batch plan that is padding (hf backend; vLLM packs)."""
    padded = sum(len(b) * max(lengths[s] for s in b) for b in batches)
    real = sum(lengths[s] for b in batches for s in b)
    return 1 - real / padded if padded else 0.0


def run(params: Params, shard: tuple[int, int] | None = None) -> None:
    """Extract every sample (or shard i of n of the batches); without a shard, build the store."""
    verifier = vf.read_verifier(params.verifier)
    n_layers, hidden = verifier.num_layers, verifier.hidden_size
    # Every drafter's layers: train's, and each family's own (layers.family_aux_layer_ids).
    aux, final = store_aux_layer_ids(params.layers, n_layers), n_layers
    rows = {
        r["id"]: r
        for split in ("train", "val")
        for r in readers.read_jsonl(INPUT_DIR / f"{split}.jsonl")
    }
    names.check_unique(list(rows), str(INPUT_DIR))
    if params.train.hidden_states == "online":
        rows = online_rows(rows, params.extract.online_keep_val)
        log(
            STAGE,
            f"train.hidden_states=online: storing {len(rows)} val samples only (what evaluate "
            "simulates on); train gets the others' hidden states from vLLM while it trains",
        )
    layout = store.StoreLayout(aux, final, hidden, params.extract.store_dtype, verifier.identity)
    settings = settings_key(params, layout, verifier.stamp)
    rows = {i: r | {"row_key": row_key(settings, r)} for i, r in rows.items()}
    work = resume.scratch_dir(STAGE, settings)
    prev, kept = published_samples({i: r["row_key"] for i, r in rows.items()})
    lengths = {i: len(r["input_ids"]) for i, r in rows.items()}
    max_tokens = params.extract.max_tokens_per_batch
    # Only the samples the last store lacks are planned: every worker plans the same batches.
    planned = {i: n for i, n in lengths.items() if i not in kept}
    mine = shard_batches(token_budget_batches(planned, max_tokens), shard)
    entries = reusable_entries(work, {s: rows[s]["row_key"] for b in mine for s in b})
    todo = [b for b in mine if not all(i in entries for i in b)]
    missing = {s for b in todo for s in b if s not in entries}
    for sid in missing:  # temp files of a killed run; batches are disjoint between workers
        for tmp in work.glob(f".{store.sample_filename(sid)}.*.tmp"):
            tmp.unlink()
    total_tokens = sum(lengths[s] for b in mine for s in b)
    done_tokens = total_tokens - sum(lengths[s] for s in missing)
    who = "" if shard is None else f"shard {shard[0]}/{shard[1]}: "
    where = prev.where if prev is not None else None
    line = published.reuse_line(len(rows), len(missing), where, len(kept), len(entries))
    log(STAGE, who + line)
    pad = padding_fraction(mine, lengths)
    largest = max((len(b) * max(lengths[s] for s in b) for b in mine), default=0)
    log(
        STAGE,
        f"{who}{sum(len(b) for b in mine)} samples in {len(mine)} batches of <= {max_tokens} "
        f"padded tokens (largest {largest}), "
        f"{_padding_note(params.extract.backend, pad)}; {len(missing)} samples to extract",
    )
    if params.extract.backend == "vllm" and todo:  # refuse before the engine's slow start
        from eagle3_pipeline.serving.hidden_states import check_prompt_lengths

        check_prompt_lengths({i: lengths[i] for b in todo for i in b}, params.vllm.max_model_len)
    left = set(missing)  # not yet written: what a failed write still needs room for
    log(
        STAGE,
        preflight(
            work,
            sum(lengths[s] for s in missing),
            sum(lengths.values()) if shard is None else 0,  # shards do not publish
            layout,
            params.extract.disk_headroom_gb,
        ),
    )

    def still_needed() -> float:
        return sum(lengths[s] for s in left) * layout.file_bytes_per_token()

    if todo:
        progress = Progress(STAGE, total_tokens, unit="tok", already_done=done_tokens)
        journal = resume.Journal(work / journal_name(shard))
        backend_dir = work if shard is None else work / f"shard-{shard[0]}-of-{shard[1]}"
        pending: list[tuple[Future, list[str]]] = []  # the write in flight, at most one

        def settle() -> None:
            """Journal the write in flight once its files are on disk."""
            while pending:
                future, batch = pending.pop()
                new = future.result()
                journal.append(new)
                entries.update({e["id"]: e for e in new})
                left.difference_update(batch)
                progress.advance(sum(lengths[i] for i in batch if i in missing))

        with (
            disk.guard(STAGE, work, still_needed),
            open_backend(
                params.extract.backend,
                ExtractionEngine(verifier, params.vllm, max_tokens, params.seed),
                layout.layer_ids,
                backend_dir / VLLM_FILES,
            ) as run_batch,
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="store-writer") as writer,
        ):
            # Batch n is written (and fsynced) while the verifier computes batch n+1.
            try:
                for batch in todo:
                    states = run_batch([rows[i]["input_ids"] for i in batch])
                    settle()
                    batch_rows = [rows[i] for i in batch]
                    future = writer.submit(
                        write_batch, work, batch_rows, states, layout, skip=set(entries)
                    )
                    pending.append((future, batch))
                settle()
            except BaseException:
                # A write that finished is journaled: a rerun redoes only the batch computing.
                with contextlib.suppress(Exception):
                    settle()
                raise
    if shard is not None:
        log(
            STAGE,
            f"{who}done ({total_tokens:,} tokens in {work}); when every shard is done, "
            "`eagle3 extract` (or `dvc repro extract`) merges them into the store",
        )
        return
    store_bytes = sum(lengths.values()) * layout.file_bytes_per_token()
    with disk.guard(STAGE, OUTPUT_DIR.parent, lambda: store_bytes):
        _publish(work, rows, entries, layout, prev, kept)
    gb = sum(lengths.values()) * layout.bytes_per_token() / 1e9
    log(
        STAGE,
        f"{len(rows)} samples, {sum(lengths.values()):,} tokens, layers {layout.layer_ids}, "
        f"{layout.dtype} {layout.bytes_per_token():,} B/token, {gb:.3f} GB -> {OUTPUT_DIR}",
    )


def _publish(
    work: Path,
    rows: dict,
    entries: dict[str, dict],
    layout: store.StoreLayout,
    prev: published.Published | None,
    kept: dict[str, dict],
) -> None:
    """Put the kept files of the last store and the scratch files into the output whole, in
    the layout of a run from scratch, then forget the scratch work.

    Files are hardlinked into the new output (copied and fsynced when scratch is on another
    filesystem, or from a DVC cache that copies) and unlinked from scratch only after the output
    is in place, so a kill or a failed write at any moment leaves either the old store or the
    new one, and the scratch work to rebuild it. Scratch files of samples no longer wanted (their
    prompt removed or changed) go with it.
    """
    atomic.sweep_temps(OUTPUT_DIR)  # a killed publish
    manifest: dict[str, dict] = {}
    with atomic.replace_dir(OUTPUT_DIR) as tmp:
        for sid, row in rows.items():
            if sid in kept:
                assert prev is not None
                entry = kept[sid] | {"split": row["split"]}  # the split is prepare's to say
                prev.put(entry["file"], tmp / entry["file"])
            else:
                entry = {k: v for k, v in entries[sid].items() if k != "id"}
                atomic.link_or_copy(work / entry["file"], tmp / entry["file"])
            manifest[sid] = entry
        store.write_manifest(tmp, layout, manifest)
    for path in work.glob(f"*{names.SUFFIX}"):
        path.unlink(missing_ok=True)
    for journal in work.glob("entries*.jsonl"):
        journal.unlink()


def _padding_note(backend: str, fraction: float) -> str:
    """hf pads each batch to its longest sample; vLLM packs sequences without padding."""
    if backend == "vllm":
        return "backend vllm (packed, no padding)"
    return f"padding {fraction:.1%}"
