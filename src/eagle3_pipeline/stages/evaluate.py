"""Stage `evaluate`: simulated acceptance of the trained drafter vs an untrained one (and, with
`train.init_from`, the init checkpoint as published, read with its own conventions), on val,
and (evaluate.online) vLLM's real acceptance and throughput with and without the drafter.

The untrained drafter (same shape, same vocab, random weights) is the floor: a trained drafter
that does not beat it clearly has learned nothing, whatever its loss curve says. The online run
is the proof that vLLM loads the drafter as it was trained: a large gap between simulated and
served acceptance means the two disagree on layers, vocab mapping, norms or verifier.
"""

from __future__ import annotations

from typing import Any

from eagle3_pipeline import atomic, paths, readers
from eagle3_pipeline.drafter import load as drafter
from eagle3_pipeline.drafter.conventions import run_conventions
from eagle3_pipeline.errors import DataError, ServerError, StoreError
from eagle3_pipeline.evaluation import offline
from eagle3_pipeline.evaluation import online as online_eval
from eagle3_pipeline.evaluation.losslessness import Verdict
from eagle3_pipeline.params import Params
from eagle3_pipeline.progress import Progress, log
from eagle3_pipeline.serving.server_spec import verifier_spec
from eagle3_pipeline.store import format as store
from eagle3_pipeline.verifier import identity as vf

STAGE = "evaluate"
DRAFTER_DIR = paths.DRAFTER
STORE_DIR = paths.HIDDEN_STATES
VOCAB_DIR = paths.VOCAB
METRICS = paths.EVAL_METRICS
VAL_PROMPTS = paths.PREPARED / "val.jsonl"
WORK_DIR = paths.SCRATCH / "evaluate"
MISMATCH_CAUSES = (
    "aux/final layer ids, vocab mapping d2t/t2d, norm_before_fc/norm_output flags, or a "
    "different verifier"
)


def run(params: Params) -> None:
    config = vf.text_config(vf.read_config(params.verifier.path))
    conventions = run_conventions(params, int(config["num_hidden_layers"]))
    aux, final = conventions.aux_layer_ids, conventions.final_layer_id
    manifest = store.read_manifest(STORE_DIR)
    store.check_layout(manifest, aux, final, STORE_DIR)
    val = {sid: e for sid, e in manifest["samples"].items() if e["split"] == "val"}
    if not val:
        raise StoreError(f"{STORE_DIR}: no val samples: raise prepare.val_ratio")
    k = params.evaluate.num_speculative_tokens
    d2t, t2d = drafter.load_mapping(VOCAB_DIR)
    models = {
        "trained": drafter.load_drafter(DRAFTER_DIR, params.verifier.path),
        "untrained": drafter.fresh_drafter_like(
            DRAFTER_DIR, params.verifier.path, d2t, t2d, params.train.seed
        ),
    }
    if params.train.init_from:
        # No fine-tuning: did training help, or would the published drafter do as well?
        models["init"] = drafter.load_drafter(params.train.init_from, params.verifier.path)
    head = offline.VerifierHead(params.verifier.path, float(config.get("rms_norm_eps", 1e-6)))
    counts = {name: offline.AcceptanceCounts(k) for name in models}
    progress = Progress(STAGE, len(val), unit="samples")
    for _sid, entry in sorted(val.items()):
        t = store.read_sample(STORE_DIR, entry)
        for name, model in models.items():
            counts[name].add(
                offline.simulate_sample(
                    model, head, t["hidden_states"], t["token_ids"], t["loss_mask"], k
                )
            )
        progress.advance()
    simulated = {name: c.summary() for name, c in counts.items()}
    result = {
        "num_speculative_tokens": k,
        "num_val_samples": len(val),
        "offline": simulated,
        "offline_gain": simulated["trained"]["mean_acceptance_length"]
        - simulated["untrained"]["mean_acceptance_length"],
    }
    if "init" in simulated:
        result["init_from"] = params.train.init_from
        result["offline_gain_over_init"] = (
            simulated["trained"]["mean_acceptance_length"]
            - simulated["init"]["mean_acceptance_length"]
        )
    tr, un = simulated["trained"], simulated["untrained"]
    log(
        STAGE,
        f"drafter {DRAFTER_DIR}: simulated mean acceptance length "
        f"{tr['mean_acceptance_length']:.3f} (untrained {un['mean_acceptance_length']:.3f}"
        + (
            f", init checkpoint {simulated['init']['mean_acceptance_length']:.3f}"
            if "init" in simulated
            else ""
        )
        + "), "
        f"acceptance rate {tr['acceptance_rate']:.1%} "
        f"over {tr['num_drafts']} drafts of {k} tokens on {len(val)} val samples",
    )
    verdict: Verdict | None = None
    if params.evaluate.online:
        section, mismatched, verdict = run_online(params)
        result |= online_verdict(section, tr["mean_acceptance_length"], mismatched, params, verdict)
    atomic.write_json(METRICS, result)
    log(STAGE, f"-> {METRICS}")
    if verdict is not None:
        require_lossless(verdict)


def val_conversations(limit: int) -> list[dict[str, Any]]:
    """The first `limit` prepared val rows (id + messages), in file order."""
    if not VAL_PROMPTS.is_file():
        raise DataError(f"{VAL_PROMPTS}: not found: run the prepare stage")
    rows = readers.read_jsonl(VAL_PROMPTS)[:limit]
    if not rows:
        raise DataError(f"{VAL_PROMPTS}: no val prompts: raise prepare.val_ratio")
    return rows


def require_lossless(verdict: Verdict) -> None:
    """The run's error when greedy outputs diverged where the baseline was sure."""
    if verdict.passed:
        return
    first = verdict.diverged[0]
    raise ServerError(
        f"greedy outputs with the drafter diverge from those without it where the baseline "
        f"was sure, on {len(verdict.diverged)} of {verdict.num_prompts} val prompts (first: "
        f"{first.describe()}; only near ties up to evaluate.near_tie_nats="
        f"{verdict.near_tie_nats} pass): speculative decoding is not lossless here; logs "
        f"in {WORK_DIR}"
    )


def run_online(params: Params) -> tuple[dict[str, Any], list[str], Verdict]:
    """Serve the verifier without, then with the drafter; (online section, differing ids,
    losslessness verdict)."""
    e = params.evaluate
    rows = val_conversations(e.max_eval_prompts)
    settings = online_eval.Settings(
        num_speculative_tokens=e.num_speculative_tokens,
        max_new_tokens=e.max_new_tokens,
        # Both runs use it, so the ratio is fair; 1 = the latency a single user sees.
        concurrency=params.evaluate.concurrency,
        chat_template_kwargs=dict(params.generate.chat_template_kwargs),
        top_logprobs=e.top_logprobs,
        near_tie_nats=e.near_tie_nats,
    )
    # No reasoning parser: the whole completion (reasoning included) is what the runs compare.
    base = verifier_spec(params, WORK_DIR / "vllm.log")
    section, differing, verdict = online_eval.evaluate(
        base,
        DRAFTER_DIR,
        [r["messages"] for r in rows],
        settings,
        WORK_DIR,
        prompt_ids=[r["id"] for r in rows],
        start_together=e.start_servers_together,
    )
    return section, [rows[i]["id"] for i in differing], verdict


def is_mismatch(online_mal: float, offline_mal: float, ratio: float) -> bool:
    """Served gain far below the simulated gain: vLLM and the trainer disagree on something."""
    return online_mal - 1 < ratio * (offline_mal - 1)


def online_verdict(
    section: dict[str, Any],
    offline_mal: float,
    mismatched: list[str],
    params: Params,
    verdict: Verdict | None = None,
) -> dict[str, Any]:
    """eval.json keys of the online run; logs summary lines and, if needed, one warning."""
    mal = section["mean_acceptance_length"]
    mismatch = is_mismatch(mal, offline_mal, params.evaluate.mismatch_ratio)
    log(
        STAGE,
        f"vLLM: mean acceptance length {mal:.3f} (simulated {offline_mal:.3f}), acceptance rate "
        f"{section['acceptance_rate']:.1%}, {section['tokens_per_s']:.1f} vs "
        f"{section['tokens_per_s_baseline']:.1f} output tokens/s without the drafter "
        f"(x{section['speedup']:.2f}) on {section['num_prompts']} val prompts",
    )
    if mismatch:
        log(
            STAGE,
            f"MISMATCH: vLLM accepts far less than simulated ({mal:.2f} vs {offline_mal:.2f}, "
            f"below evaluate.mismatch_ratio={params.evaluate.mismatch_ratio}); likely causes: "
            f"{MISMATCH_CAUSES}: compare {DRAFTER_DIR}/config.json with the served verifier",
        )
    section = section | {"greedy_mismatched_ids": mismatched[:20]}
    out = {"online": section, "greedy_outputs_identical": not mismatched, "mismatch": mismatch}
    if verdict is not None:
        out["lossless"] = verdict.section()
        near = verdict.near_ties
        log(
            STAGE,
            f"losslessness: {verdict.outcome} (identical on "
            f"{out['lossless']['num_identical']}, near ties on {len(near)}, diverged on "
            f"{len(verdict.diverged)} of {verdict.num_prompts} prompts; top-"
            f"{verdict.top_logprobs} logprobs, near tie <= {verdict.near_tie_nats} nats)"
            + (f"; first near tie: {near[0].describe()}" if near else ""),
        )
    return out
