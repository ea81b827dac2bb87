"""Stage `export`: the drafter directory vLLM loads (speculators format), checked by loading it.

Config flags are written once, here, from the same params the trainer used; the verifier is named
by the params' identity (hub id or repo-relative path), never by an absolute path.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from eagle3_pipeline import atomic, drafter
from eagle3_pipeline import verifier as vf
from eagle3_pipeline.layers import resolve_layer_ids
from eagle3_pipeline.params import Params
from eagle3_pipeline.progress import log

STAGE = "export"
INPUT_DIR = Path("models/trained/best")
VOCAB_DIR = Path("data/vocab")
OUTPUT_DIR = Path("models/drafter")


def run(params: Params) -> None:
    n_layers, _, _ = vf.shape(vf.read_config(params.verifier.path))
    aux, final = resolve_layer_ids(params.layers, n_layers)
    ident = vf.identity(params)
    expected = drafter.expected_config(aux, params.vocab.draft_vocab_size, params.verifier.path)
    drafter.check_config(INPUT_DIR, expected)
    config = json.loads((INPUT_DIR / "config.json").read_text())
    config.pop("auto_map", None)  # speculators' class is registered; no remote code needed
    config["speculators_config"]["verifier"]["name_or_path"] = ident["name_or_path"]
    config["eagle3_pipeline"] = {
        "verifier": ident,
        "aux_layer_ids": aux,
        "final_layer_id": final,
        "layer_convention": "vllm",
        "num_speculative_tokens": params.evaluate.num_speculative_tokens,
    }
    with atomic.replace_dir(OUTPUT_DIR) as tmp:
        shutil.copy2(INPUT_DIR / "model.safetensors", tmp / "model.safetensors")
        atomic.write_json(tmp / "config.json", config)
    model = drafter.load_drafter(OUTPUT_DIR)
    d2t, t2d = drafter.load_mapping(VOCAB_DIR)
    drafter.check_mapping(model, d2t, t2d, OUTPUT_DIR)
    drafter.check_config(OUTPUT_DIR, expected | {"verifier_name_or_path": ident["name_or_path"]})
    n_params = sum(p.numel() for p in model.parameters())
    log(
        STAGE,
        f"{OUTPUT_DIR}: speculators format, {n_params:,} params, aux {aux}, draft vocab "
        f"{params.vocab.draft_vocab_size}; loaded back and checked",
    )
