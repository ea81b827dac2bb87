"""Stage `export`: the drafter directory a server loads, checked by loading it back.

`export.format: speculators` (default) writes speculators' own layout, which vLLM auto-detects;
`flat` writes the legacy EAGLE-3 layout (flat_format.py) that SGLang and older vLLM load, its
aux-layer ids in the convention of `export.server`. Config flags are written once, here, from
the run's conventions (drafter.conventions: params + the init checkpoint, the trainer's source),
checked against what speculators saved; the verifier is named by the params' identity (hub id or
repo-relative path); a verifier named apart from its folder also records the folder it was built
from (`verifier.path`, which may be absolute: it is where the user keeps the model).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from eagle3_pipeline.config.params import Params
from eagle3_pipeline.core import atomic, paths
from eagle3_pipeline.core.errors import CheckpointError, ParamsError
from eagle3_pipeline.core.progress import log
from eagle3_pipeline.drafter import flat_format
from eagle3_pipeline.drafter import load as drafter
from eagle3_pipeline.drafter.conventions import FLAGS, run_conventions
from eagle3_pipeline.verifier import identity as vf

STAGE = "export"
INPUT_DIR = paths.TRAINED / "best"
VOCAB_DIR = paths.VOCAB
OUTPUT_DIR = paths.DRAFTER


def run(params: Params) -> None:
    family = params.train.family.name
    if params.train.family.speculator_type != "eagle3":
        # Its checkpoint is trained and kept (data/trained); export checks and evaluate
        # simulates EAGLE-3's drafter only (3.1 is one, other flags), so they refuse rather
        # than pass a wrong drafter on.
        raise ParamsError(
            "params.yaml: field 'train.family.name': export and evaluate handle eagle3 and "
            f"eagle3.1 only, and {family} was trained (its checkpoint is in {paths.TRAINED}): "
            "stop after train (`dvc repro train`) or set train.family.name: eagle3"
        )
    verifier = vf.read_verifier(params.verifier)
    conventions = run_conventions(params.layers, params.train, verifier.num_layers)
    aux, final = conventions.aux_layer_ids, conventions.final_layer_id
    ident = verifier.identity
    fmt, server = params.export.format, params.export.server
    expected = drafter.expected_config(
        conventions, params.vocab.draft_vocab_size, params.verifier.path
    )
    drafter.check_config(INPUT_DIR, expected)
    # The name is what vLLM and a model card show; the folder is what the drafter was built from.
    built_from = (
        {"path": params.verifier.path} if params.verifier.path != ident["name_or_path"] else {}
    )
    record = {
        "verifier": ident | built_from,
        "aux_layer_ids": aux,
        "final_layer_id": final,
        # The convention of the ids written in this directory's config.json.
        "layer_convention": server if fmt == "flat" else "vllm",
        "num_speculative_tokens": params.evaluate.num_speculative_tokens,
    }
    with atomic.replace_dir(OUTPUT_DIR) as tmp:
        if fmt == "flat":
            flat_format.write_flat(INPUT_DIR, tmp, server, {"eagle3_pipeline": record})
        else:
            config = json.loads((INPUT_DIR / "config.json").read_text())
            config.pop("auto_map", None)  # speculators' class is registered; no remote code
            config["speculators_config"]["verifier"]["name_or_path"] = ident["name_or_path"]
            # Every flag explicit: vLLM reads an absent norm_before_residual as true.
            config |= {k: conventions.flags[k] for k in FLAGS}
            config["eagle3_pipeline"] = record
            shutil.copy2(INPUT_DIR / "model.safetensors", tmp / "model.safetensors")
            atomic.write_json(tmp / "config.json", config)
    model = drafter.load_drafter(OUTPUT_DIR, params.verifier.path)
    if fmt == "flat":
        check_same_tensors(INPUT_DIR, OUTPUT_DIR)
    d2t, t2d = drafter.load_mapping(VOCAB_DIR)
    drafter.check_mapping(model, d2t, t2d, OUTPUT_DIR)
    drafter.check_config(OUTPUT_DIR, expected | {"verifier_name_or_path": ident["name_or_path"]})
    n_params = sum(p.numel() for p in model.parameters())
    if fmt == "flat":
        written = json.loads((OUTPUT_DIR / "config.json").read_text())["eagle_config"]
        layout = (
            f"flat format for {server} (eagle_config aux ids "
            f"{written['eagle_aux_hidden_state_layer_ids']} in {server}'s convention = our {aux})"
        )
    else:
        layout = f"speculators format, aux {aux}"
    log(
        STAGE,
        f"{OUTPUT_DIR}: {layout}, {n_params:,} params, draft vocab "
        f"{params.vocab.draft_vocab_size}; loaded back and checked",
    )


def check_same_tensors(src: Path, flat: Path) -> None:
    """Every tensor of the trained checkpoint, bit for bit, under its flat name; nothing else."""
    from safetensors.torch import load_file

    want = load_file(str(src / "model.safetensors"))
    got = flat_format.open_checkpoint(flat)
    if sorted(want) != got.names():
        raise CheckpointError(
            f"{flat}/model.safetensors holds {got.names()} but {src} holds {sorted(want)}: "
            "re-run the export stage"
        )
    for name, tensor in want.items():
        other = got.tensor(name)
        if other.dtype != tensor.dtype or not torch.equal(other, tensor):
            raise CheckpointError(
                f"{flat}/model.safetensors: {flat_format.flat_tensor_name(name)} differs from "
                f"{src}'s {name}: re-run the export stage"
            )
