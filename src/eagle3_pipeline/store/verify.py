"""`eagle3 store verify`: is every file of a hidden-state store exactly what extract wrote?

Re-hashes each file against the manifest and checks its content (keys, dtypes, shapes, layer
ids, finite values) and its token ids and loss mask against the tokenized input it was extracted
from. DVC only notices a changed file; this also catches a store extracted from other inputs, a
manifest that lies, and files nobody listed. Prints one line per bad file, exit 1 if any.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from eagle3_pipeline.config.layer_ids import resolve_layer_ids
from eagle3_pipeline.config.params import LayersParams
from eagle3_pipeline.core import paths, readers
from eagle3_pipeline.core.errors import StoreError
from eagle3_pipeline.core.progress import Progress, log
from eagle3_pipeline.store import format as store
from eagle3_pipeline.verifier.identity import VerifierFacts

TOKENIZED_DIR = paths.TOKENIZED
MAX_LISTED = 20  # files named in a report; the rest are counted
STAGE = "store verify"


def _tokenized_rows() -> dict[str, dict[str, Any]]:
    rows = {}
    for split in ("train", "val"):
        path = TOKENIZED_DIR / f"{split}.jsonl"
        if not path.is_file():
            raise StoreError(
                f"{path}: missing, so token ids cannot be checked: run `dvc repro tokenize` "
                "or `dvc pull tokenize`"
            )
        rows |= {r["id"]: r | {"split": split} for r in readers.read_jsonl(path)}
    return rows


def _check_one(root: Path, entry: dict, layout: store.StoreLayout, row: dict | None) -> list[str]:
    path = root / entry["file"]
    if not path.is_file():
        return ["file missing"]
    problems = store.check_file(path.read_bytes(), entry, layout, row)
    if row is not None and entry.get("split") not in (None, row["split"]):
        problems.append(f"split {entry.get('split')!r}, tokenized input says {row['split']!r}")
    return problems


def verify(verifier: VerifierFacts, layers: LayersParams, root: Path) -> dict[str, list[str]]:
    """{file or manifest field: problems}; empty when the store is good (`layers`: the layer
    ids params ask for)."""
    manifest = store.read_manifest(root)
    bad: dict[str, list[str]] = {}
    hidden = verifier.hidden_size
    aux, final = resolve_layer_ids(layers, verifier.num_layers)
    layout = store.layout_of(manifest)
    if (layout.aux_layer_ids, layout.final_layer_id) != (aux, final):
        bad[store.MANIFEST] = [
            f"layer ids {layout.layer_ids}, params ask for {[*aux, final]}: rerun extract"
        ]
    if layout.hidden_size != hidden:
        bad.setdefault(store.MANIFEST, []).append(
            f"hidden_size {layout.hidden_size}, the verifier has {hidden}: rerun extract"
        )
    if manifest.get("dtype") not in store.TORCH_DTYPES:
        bad.setdefault(store.MANIFEST, []).append(f"dtype {manifest.get('dtype')!r} unknown")
        return bad
    rows = _tokenized_rows()
    samples: dict[str, dict] = manifest["samples"]
    for sid in sorted(set(rows) - set(samples)):
        bad[store.sample_filename(sid)] = ["in the tokenized input but not in the manifest"]
    listed = {e["file"] for e in samples.values()}
    for path in sorted(root.iterdir()):
        if path.name not in listed and path.name != store.MANIFEST:
            bad[path.name] = ["not in the manifest (a leftover or a foreign file)"]
    if manifest.get("num_tokens") != sum(e["num_tokens"] for e in samples.values()):
        bad.setdefault(store.MANIFEST, []).append("num_tokens differs from the sum of its files")
    progress = Progress(STAGE, len(samples), unit="files")

    def check(item: tuple[str, dict]) -> tuple[str, list[str]]:
        sid, entry = item
        row = rows.get(sid)
        problems = _check_one(root, entry, layout, row)
        if row is None:
            problems.append("sample id not in the tokenized input (store from other inputs?)")
        progress.advance()
        return entry["file"], problems

    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        for name, problems in pool.map(check, sorted(samples.items())):
            if problems:
                bad[name] = problems
    return bad


def main(
    verifier: VerifierFacts, layers: LayersParams, store_dir: str = str(paths.HIDDEN_STATES)
) -> int:
    """Print a report; 0 when every file is good, 1 otherwise."""
    root = Path(store_dir)
    bad = verify(verifier, layers, root)
    manifest = store.read_manifest(root)
    if not bad:
        log(
            STAGE,
            f"OK: {root}: {manifest['num_samples']} files, {manifest['num_tokens']:,} tokens, "
            f"{manifest['dtype']}, layer ids {manifest['layer_ids']}: hashes, shapes, dtypes "
            "and token ids all match",
        )
        return 0
    shown = sorted(bad.items())[:MAX_LISTED]
    for name, problems in shown:
        print(f"BAD {root / name}: {'; '.join(problems)}", flush=True)
    if len(bad) > len(shown):
        print(f"BAD ... and {len(bad) - len(shown)} more files (first {len(shown)} listed)")
    linked = sorted(
        str(root / n) for n in bad if (root / n).is_file() and (root / n).stat().st_nlink > 1
    )
    if linked:
        # With DVC's hardlink cache the damaged file IS the cache object, and DVC trusts a
        # read-only cache object without re-hashing: `dvc repro` would check the damage out
        # again ("Stage is cached - skipping run"). Making it writable makes DVC re-hash it.
        files = " ".join(linked) if len(linked) <= MAX_LISTED else f"-R {root}"
        print(
            f"FIX {len(linked)} of them are hardlinked to the DVC cache, so the cached copies "
            f"are damaged too: chmod u+w {files} && dvc repro extract",
            flush=True,
        )
    log(
        STAGE,
        f"{root}: {len(bad)} bad ({manifest['num_samples']} files in the manifest): "
        "`eagle3 extract` (or `dvc repro extract`) extracts the store again",
    )
    return 1
