"""Stage `verifier`: build the tiny verifier (tiny profiles) or record a real one's identity.

The builder is verifier/tiny.py; a real verifier is never hashed (547 GB for Kimi-K2.5): the
stage records its path, revision and config hash, which later stages key their work on.
"""

from __future__ import annotations

from pathlib import Path

from eagle3_pipeline.config.params import Params
from eagle3_pipeline.core import atomic, paths
from eagle3_pipeline.core.errors import ParamsError
from eagle3_pipeline.core.progress import log
from eagle3_pipeline.verifier import identity as vf
from eagle3_pipeline.verifier.tiny import build_tiny

STAGE = "verifier"
OUTPUT_DIR = str(paths.VERIFIER)


def run(params: Params) -> None:
    out_dir = Path(OUTPUT_DIR)
    if params.verifier.source == "pretrained":
        facts = vf.read_verifier(params.verifier)
        layers, hidden, vocab = vf.shape(facts.config)
        with atomic.replace_dir(out_dir) as tmp:
            atomic.write_json(
                tmp / "identity.json",
                facts.identity
                | {"num_hidden_layers": layers, "hidden_size": hidden, "vocab_size": vocab},
            )
        log(STAGE, f"pretrained verifier {params.verifier.path}: {layers} layers, vocab {vocab}")
        return
    if Path(params.verifier.path) != out_dir:
        raise ParamsError(
            f"params.yaml: verifier.path={params.verifier.path} but a tiny verifier is built into "
            f"{OUTPUT_DIR}: set verifier.path: {OUTPUT_DIR}"
        )
    with atomic.replace_dir(out_dir) as tmp:
        stats = build_tiny(params.verifier.tiny, params.seed, tmp)
        atomic.write_json(tmp / "build_stats.json", stats)
    facts = vf.read_verifier(params.verifier)
    atomic.write_json(out_dir / "identity.json", facts.identity)
    layers, vocab = facts.num_layers, facts.vocab_size
    log(STAGE, f"tiny verifier written to {out_dir}: {layers} layers, vocab {vocab}")
