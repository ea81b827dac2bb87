"""Stage `evaluate`: simulated acceptance of the trained drafter vs an untrained one, on val.

The untrained drafter (same shape, same vocab, random weights) is the floor: a trained drafter
that does not beat it clearly has learned nothing, whatever its loss curve says.
"""

from __future__ import annotations

from pathlib import Path

from eagle3_pipeline import acceptance, atomic, drafter, store
from eagle3_pipeline import verifier as vf
from eagle3_pipeline.errors import StoreError
from eagle3_pipeline.layers import resolve_layer_ids
from eagle3_pipeline.params import Params
from eagle3_pipeline.progress import Progress, log

STAGE = "evaluate"
DRAFTER_DIR = Path("models/drafter")
STORE_DIR = Path("data/hidden_states")
VOCAB_DIR = Path("data/vocab")
METRICS = Path("metrics/eval.json")


def run(params: Params) -> None:
    config = vf.text_config(vf.read_config(params.verifier.path))
    aux, final = resolve_layer_ids(params.layers, int(config["num_hidden_layers"]))
    manifest = store.read_manifest(STORE_DIR)
    store.check_layout(manifest, aux, final, STORE_DIR)
    val = {sid: e for sid, e in manifest["samples"].items() if e["split"] == "val"}
    if not val:
        raise StoreError(f"{STORE_DIR}: no val samples: raise prepare.val_ratio")
    k = params.evaluate.num_speculative_tokens
    d2t, t2d = drafter.load_mapping(VOCAB_DIR)
    models = {
        "trained": drafter.load_drafter(DRAFTER_DIR),
        "untrained": drafter.fresh_drafter_like(DRAFTER_DIR, d2t, t2d, params.train.seed),
    }
    head = acceptance.VerifierHead(params.verifier.path, float(config.get("rms_norm_eps", 1e-6)))
    counts = {name: acceptance.AcceptanceCounts(k) for name in models}
    progress = Progress(STAGE, len(val), unit="samples")
    for _sid, entry in sorted(val.items()):
        t = store.read_sample(STORE_DIR, entry)
        for name, model in models.items():
            counts[name].add(
                acceptance.simulate_sample(
                    model, head, t["hidden_states"], t["token_ids"], t["loss_mask"], k
                )
            )
        progress.advance()
    offline = {name: c.summary() for name, c in counts.items()}
    result = {
        "num_speculative_tokens": k,
        "num_val_samples": len(val),
        "offline": offline,
        "offline_gain": offline["trained"]["mean_acceptance_length"]
        - offline["untrained"]["mean_acceptance_length"],
    }
    atomic.write_json(METRICS, result)
    tr, un = offline["trained"], offline["untrained"]
    log(
        STAGE,
        f"drafter {DRAFTER_DIR}: simulated mean acceptance length "
        f"{tr['mean_acceptance_length']:.3f} (untrained {un['mean_acceptance_length']:.3f}), "
        f"acceptance rate {tr['acceptance_rate']:.1%} "
        f"over {tr['num_drafts']} drafts of {k} tokens on {len(val)} val samples -> {METRICS}",
    )
