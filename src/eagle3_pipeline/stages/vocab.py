"""Stage `vocab`: the draft vocabulary (d2t/t2d) from supervised token frequencies.

d2t holds offsets (target id = draft id + d2t[draft id]); t2d is a bool mask over the target
vocab. Built with speculators' own builder so the mapping is the one its trainer expects.
"""

from __future__ import annotations

import io
import json

import numpy as np

from eagle3_pipeline.config.params import Params
from eagle3_pipeline.core import atomic, paths
from eagle3_pipeline.core.errors import DataError, ParamsError
from eagle3_pipeline.core.progress import log
from eagle3_pipeline.verifier import identity as vf

STAGE = "vocab"
INPUT = paths.TOKEN_FREQ
OUTPUT_DIR = paths.VOCAB
METRICS = paths.VOCAB_METRICS


def _npy_bytes(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return buf.getvalue()


def run(params: Params) -> None:
    import torch
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    target_vocab = vf.read_verifier(params.verifier).vocab_size
    draft_vocab = params.vocab.draft_vocab_size
    if draft_vocab > target_vocab:
        raise ParamsError(
            f"params.yaml: vocab.draft_vocab_size={draft_vocab} is larger than the verifier vocab "
            f"({target_vocab}): lower vocab.draft_vocab_size"
        )
    freq = {int(k): int(v) for k, v in json.loads(INPUT.read_text()).items()}
    if not freq:
        raise DataError(f"{INPUT}: no supervised tokens counted: check the tokenize stage")
    d2t, t2d = build_vocab_mappings_from_distribution(freq, draft_vocab, target_vocab)
    selected = (torch.arange(draft_vocab) + d2t).tolist()
    total = sum(freq.values())
    covered = sum(freq.get(t, 0) for t in selected)
    coverage = covered / total
    with atomic.replace_dir(OUTPUT_DIR) as tmp:
        atomic.write_bytes(tmp / "d2t.npy", _npy_bytes(d2t.numpy()))
        atomic.write_bytes(tmp / "t2d.npy", _npy_bytes(t2d.numpy()))
    atomic.write_json(
        METRICS,
        {
            "draft_vocab_size": draft_vocab,
            "target_vocab_size": target_vocab,
            "distinct_supervised_tokens": len(freq),
            "coverage": round(coverage, 6),
        },
    )
    log(
        STAGE,
        f"draft vocab {draft_vocab} of {target_vocab}: covers {coverage:.2%} of "
        f"{total:,} supervised tokens ({len(freq)} distinct) -> {OUTPUT_DIR}",
    )
