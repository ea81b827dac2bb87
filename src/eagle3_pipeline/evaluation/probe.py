"""`eagle3 probe-layers`: which aux layer ids does the init drafter read? Measured before the
big extract.

A drafter's fc was trained on the features of particular layers; fed others (a SpecForge id read
in vLLM's convention is one layer early) it drafts badly, and a whole store extracted at those
ids is wasted. The probe extracts a few tokenized samples once, at the union of the candidate
id sets plus the final id (the extract stage's backends: `hf` hooks or vLLM's
`extract_hidden_states`), into data/.work/probe/, then simulates the init drafter
(`train.init_from`, read with its own conventions) on each id set as the evaluate stage does
(evaluation/offline.py, verifier greedy tokens once per sample) and prints the acceptance of
each. The scratch files are removed at the end.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from eagle3_pipeline.config.layer_ids import resolve_layer_ids
from eagle3_pipeline.config.params import Params
from eagle3_pipeline.core import paths, readers
from eagle3_pipeline.core.errors import DataError, ParamsError
from eagle3_pipeline.core.progress import Progress, log
from eagle3_pipeline.drafter import load as drafter_load
from eagle3_pipeline.evaluation import offline
from eagle3_pipeline.serving.hidden_states import ExtractionEngine
from eagle3_pipeline.store import format as store
from eagle3_pipeline.store.extraction import open_backend, token_budget_batches
from eagle3_pipeline.verifier import identity as vf

STAGE = "probe-layers"
WORK_DIR = paths.SCRATCH / "probe"
INPUT_DIR = paths.TOKENIZED


def parse_ids(text: str) -> list[int]:
    """`2,30,58` -> [2, 30, 58]; a malformed list is one ParamsError line."""
    try:
        ids = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ParamsError(f"--ids {text}: expected comma-separated ids, e.g. 3,31,59") from None
    if not ids or len(set(ids)) != len(ids):
        raise ParamsError(f"--ids {text}: expected distinct layer ids, e.g. 3,31,59")
    return ids


def check_id_sets(id_sets: list[list[int]], final: int, n_aux: int, drafter: str) -> None:
    for ids in id_sets:
        if any(not 0 <= i < final for i in ids):
            raise ParamsError(
                f"--ids {','.join(map(str, ids))}: layer ids must lie in [0, {final}) (vLLM's "
                f"convention: id k enters layer k; {final} is the final id, always added)"
            )
        if len(ids) != n_aux:
            raise ParamsError(
                f"--ids {','.join(map(str, ids))}: {len(ids)} ids, but the drafter {drafter} "
                f"reads {n_aux}: give {n_aux} ids per set"
            )


def probe_rows(limit: int) -> list[dict[str, Any]]:
    """The first `limit` tokenized samples: val rows first, then train, each by id."""
    rows: list[dict[str, Any]] = []
    for split in ("val", "train"):
        path = INPUT_DIR / f"{split}.jsonl"
        if not path.is_file():
            raise DataError(f"{path}: not found: run the tokenize stage first (dvc repro tokenize)")
        rows += sorted(readers.read_jsonl(path), key=lambda r: r["id"])
    if not rows:
        raise DataError(f"{INPUT_DIR}: no tokenized samples: run the tokenize stage first")
    return rows[:limit]


def extract(
    engine: ExtractionEngine,
    rows: list[dict[str, Any]],
    layout: store.StoreLayout,
    backend: str,
) -> dict[str, dict[str, Any]]:
    """Hidden states of `rows` at layout.layer_ids into WORK_DIR; their store entries by id."""
    entries: dict[str, dict[str, Any]] = {}
    progress = Progress(STAGE, sum(len(r["input_ids"]) for r in rows), unit="tok")
    by_id = {r["id"]: r for r in rows}
    lengths = {r["id"]: len(r["input_ids"]) for r in rows}
    with open_backend(backend, engine, layout.layer_ids, WORK_DIR / "vllm") as run_batch:
        for ids in token_budget_batches(lengths, engine.max_tokens_per_batch):
            batch = [by_id[i] for i in ids]
            states = run_batch([r["input_ids"] for r in batch])
            written = store.write_samples(
                WORK_DIR,
                [
                    (r["id"], hs, torch.tensor(r["input_ids"]), torch.tensor(r["loss_mask"]))
                    for r, hs in zip(batch, states, strict=True)
                ],
                layout,
            )
            entries.update({r["id"]: e for r, e in zip(batch, written, strict=True)})
            progress.advance(sum(len(r["input_ids"]) for r in batch))
    return entries


def run(
    params: Params,
    id_sets: list[list[int]],
    samples: int = 100,
    backend: str | None = None,
    drafter: str | Path | None = None,
) -> dict[str, dict[str, Any]]:
    """Simulated acceptance of the init drafter at each id set; {"a,b,c": summary}."""
    path = drafter or params.train.init_from
    if not path:
        raise ParamsError(
            "probe-layers: no drafter to probe: set train.init_from (or pass --drafter PATH)"
        )
    verifier = vf.read_verifier(params.verifier)
    n_layers, hidden = verifier.num_layers, verifier.hidden_size
    _, final = resolve_layer_ids(params.layers, n_layers)
    k = params.evaluate.num_speculative_tokens
    device, dtype = drafter_load.compute_placement()
    model = drafter_load.load_drafter(path, params.verifier.path, device, dtype)
    n_aux = model.fc.in_features // hidden  # fc reads the aux ids' states side by side
    check_id_sets(id_sets, final, n_aux, str(path))
    rows = probe_rows(samples)
    union = sorted({i for ids in id_sets for i in ids})
    layout = store.StoreLayout(union, final, hidden, params.extract.store_dtype, verifier.identity)
    backend = backend or params.extract.backend
    log(
        STAGE,
        f"{len(rows)} samples, layers {layout.layer_ids} ({backend} backend) -> {WORK_DIR}; "
        f"drafter {path} on {device.type} ({str(dtype).removeprefix('torch.')})",
    )
    shutil.rmtree(WORK_DIR, ignore_errors=True)
    try:
        engine = ExtractionEngine(
            verifier, params.vllm, params.extract.max_tokens_per_batch, params.seed
        )
        entries = extract(engine, rows, layout, backend)
        head = offline.VerifierHead(
            params.verifier.path,
            float(verifier.text.get("rms_norm_eps", 1e-6)),
            device,
            dtype,
        )
        counts = {tuple(ids): offline.AcceptanceCounts(k) for ids in id_sets}
        for sid in sorted(entries):
            t = store.read_sample(WORK_DIR, entries[sid])
            hs = t["hidden_states"]
            greedy = head.greedy(hs[:, -1])  # once per sample, for every id set
            for ids in counts:
                columns = [union.index(i) for i in ids] + [len(union)]
                ok = offline.draft_matches(model, hs[:, columns], t["token_ids"], greedy, k)
                counts[ids].add(offline.accepted_prefix(ok, t["loss_mask"]))
    finally:
        shutil.rmtree(WORK_DIR, ignore_errors=True)
    result = {",".join(map(str, ids)): c.summary() for ids, c in counts.items()}
    best = max(result, key=lambda key: result[key]["mean_acceptance_length"])
    for key, summary in result.items():
        print(
            f"[{STAGE}] ids {key} + {final}: simulated mean acceptance length "
            f"{summary['mean_acceptance_length']:.3f}, acceptance rate "
            f"{summary['acceptance_rate']:.1%}, per position "
            f"{[round(a, 3) for a in summary['acceptance_per_position']]} over "
            f"{summary['num_drafts']} drafts" + ("  <- best" if key == best else ""),
            flush=True,
        )
    return result
