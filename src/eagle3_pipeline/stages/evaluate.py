"""Stage `evaluate`: simulated acceptance of the trained drafter vs an untrained one (and, with
`train.init_from`, the init checkpoint as published, read with its own conventions), on val,
and (evaluate.online) vLLM's real acceptance with the drafter and its speed-up over the verifier
served without it (paired rounds: evaluation/speedup.py).

The untrained drafter (same shape, same vocab, random weights) is the floor: a trained drafter
that does not beat it clearly has learned nothing, whatever its loss curve says. The online run
is the proof that vLLM loads the drafter as it was trained: served acceptance short of the
simulated one on the same prompts and positions (offline_same_prompts) means the two disagree
on layers, vocab mapping, norms or verifier.

The simulation runs on the GPU in bf16 where there is one (CPU: fp32), on at most
evaluate.max_offline_samples val samples, and is released before the servers start.
"""

from __future__ import annotations

import dataclasses
import gc
from pathlib import Path
from typing import Any

import torch

from eagle3_pipeline.config import families
from eagle3_pipeline.config.params import Params
from eagle3_pipeline.core import atomic, paths, readers
from eagle3_pipeline.core.errors import DataError, ParamsError, ServerDown, StoreError
from eagle3_pipeline.core.progress import Progress, log
from eagle3_pipeline.drafter import load as drafter
from eagle3_pipeline.drafter.conventions import run_conventions
from eagle3_pipeline.evaluation import (
    draft_sweep,
    measure,
    offline,
    parallel_offline,
)
from eagle3_pipeline.evaluation import online as online_eval
from eagle3_pipeline.evaluation.headline import served_headline
from eagle3_pipeline.evaluation.held_out import load_sets
from eagle3_pipeline.evaluation.losslessness import Verdict
from eagle3_pipeline.evaluation.verdict import online_verdict, require_lossless
from eagle3_pipeline.serving import served_with
from eagle3_pipeline.serving.server_spec import verifier_spec
from eagle3_pipeline.store import format as store
from eagle3_pipeline.verifier import identity as vf

STAGE = "evaluate"
DRAFTER_DIR = paths.DRAFTER
STORE_DIR = paths.HIDDEN_STATES
VOCAB_DIR = paths.VOCAB
METRICS = paths.EVAL_METRICS
VAL_PROMPTS = paths.PREPARED / "val.jsonl"
TRAIN_PROMPTS = paths.PREPARED / "train.jsonl"
WORK_DIR = paths.SCRATCH / "evaluate"
RERUN_HINT = "rerun `dvc repro` to evaluate again (the stages before evaluate are kept)"


def run(params: Params) -> None:
    e = params.evaluate
    verifier = vf.read_verifier(params.verifier)
    simulated, result = simulate_offline(params, verifier)
    tr = simulated["trained"]
    verdict: Verdict | None = None
    if e.online:
        section, mismatched, verdict = run_online(
            params,
            aux_layer_ids=_trained_layers(params, verifier),
            held_out=True,
            verifier=verifier,
        )
        held = section.pop("held_out", {})
        result |= online_verdict(
            section,
            tr["mean_acceptance_length"],
            mismatched,
            params.evaluate,
            verdict,
            offline_same=result.get("offline_same_prompts"),
        )
        headline = served_headline(result["online"], held, params.evaluate, VAL_PROMPTS)
        result = {"served": headline} | result
    atomic.write_json(METRICS, result, sort_keys="served" not in result)  # the headline first
    log(STAGE, f"-> {METRICS}")
    if verdict is not None:
        require_lossless(verdict, WORK_DIR)


def run_family(params: Params, name: str) -> None:
    """`family@NAME`'s evaluation (`eagle3 evaluate --family NAME`): the branch's best
    checkpoint simulated offline as its family drafts, then served by vLLM with and without it on
    the same val prompts and settings as `evaluate`'s online run, vLLM's figure checked against
    the simulation like evaluate's; metrics/families/NAME/eval.json."""
    family, e = families.entry(params.families, name), params.evaluate
    most = family.drafts_per_pass
    k = max([e.num_speculative_tokens, *e.num_speculative_tokens_sweep])
    if most is not None and k > most:
        field = "num_speculative_tokens" + ("" if k == e.num_speculative_tokens else "_sweep")
        raise ParamsError(
            f"params.yaml: field 'evaluate.{field}': {k} drafts, but "
            f"families.{name} ({family.name}) was trained to draft {most} per "
            "pass: lower it or raise the family's num_depths / block_size"
        )
    drafter_dir = paths.FAMILIES_MODELS / name / "best"
    verifier = vf.read_verifier(params.verifier)
    own = _trained_layers(params, verifier, name)
    simulated = simulate_family(params, name, drafter_dir, own, verifier)
    section, mismatched, verdict = run_online(
        params, drafter_dir, family.name, WORK_DIR / "families" / name, own, verifier=verifier
    )
    out = paths.FAMILIES_METRICS / name / "eval.json"
    result: dict[str, Any] = {"family": family.name, "drafting": family.drafting, **simulated}
    result |= online_verdict(
        section,
        simulated["offline"]["trained"]["mean_acceptance_length"],
        mismatched,
        params.evaluate,
        verdict,
        simulated.get("offline_same_prompts"),
        drafter_dir,
    )
    atomic.write_json(out, result)
    log(STAGE, f"losslessness: {verdict.outcome} -> {out}")
    require_lossless(verdict, WORK_DIR / "families" / name)


def simulate_offline(
    params: Params, verifier: vf.VerifierFacts | None = None
) -> tuple[dict[str, dict], dict[str, Any]]:
    """(summary per drafter, eval.json keys) of the simulation on the store's val samples
    (`verifier`: the run's, read here when not given)."""
    verifier = verifier or vf.read_verifier(params.verifier)
    config = verifier.text
    conventions = run_conventions(params.layers, params.train, verifier.num_layers)
    aux, final = conventions.aux_layer_ids, conventions.final_layer_id
    manifest = store.read_manifest(STORE_DIR)
    positions = store.check_layout(manifest, aux, final, STORE_DIR)
    val, whole, same = _val_samples(params, manifest)
    e = params.evaluate
    k = e.num_speculative_tokens
    device, dtype = drafter.compute_placement()
    d2t, t2d = drafter.load_mapping(VOCAB_DIR)
    models = {
        "trained": drafter.load_drafter(DRAFTER_DIR, params.verifier.path, device, dtype),
        "untrained": drafter.fresh_drafter_like(
            DRAFTER_DIR, params.verifier.path, d2t, t2d, params.train.seed, device, dtype
        ),
    }
    if params.train.init_from:
        # No fine-tuning: did training help, or would the published drafter do as well?
        models["init"] = drafter.load_drafter(
            params.train.init_from, params.verifier.path, device, dtype
        )
    sim = _simulate(params, config, models, (val, positions), whole, same)
    simulated = {name: c.summary() for name, c in sim.whole.items()}
    result: dict[str, Any] = {
        "num_speculative_tokens": k,
        "num_val_samples": len(val),
        "offline_run": {
            "samples_simulated": len(whole),
            "samples_total": len(val),
            "max_offline_samples": e.max_offline_samples,
            "device": device.type,
            "dtype": str(dtype).removeprefix("torch."),
        },
        "offline": simulated,
        "offline_gain": simulated["trained"]["mean_acceptance_length"]
        - simulated["untrained"]["mean_acceptance_length"],
    }
    if sim.same is not None:
        result["offline_same_prompts"] = draft_sweep.same_prompts(sim, params.evaluate)
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
        f"over {tr['num_drafts']} drafts of {k} tokens on {len(whole)} of {len(val)} val "
        f"samples ({device.type}, {result['offline_run']['dtype']})",
    )
    if sim.same is not None:
        same_mal = result["offline_same_prompts"]["mean_acceptance_length"]
        log(
            STAGE,
            f"simulated on the online run's {sim.num_same} prompts, first {e.max_new_tokens} "
            f"answer tokens, as vLLM drafts them: mean acceptance length {same_mal:.3f}",
        )
    return simulated, result


def _simulate(
    params: Params,
    config: dict[str, Any],
    models: dict[str, Any],
    store_at: tuple[dict[str, dict], list[int]],
    whole: list[str],
    same: list[str],
    matches: Any = offline.draft_matches,
) -> offline.Simulation:
    """`offline.simulate` of `models` on the store's val samples (`store_at`: their entries,
    the drafters' layer positions in the files), with progress. Empties `models` and frees the
    GPU memory afterwards: vLLM starts next."""
    e = params.evaluate
    val, positions = store_at
    device, dtype = drafter.compute_placement()
    head = offline.VerifierHead(
        params.verifier.path, float(config.get("rms_norm_eps", 1e-6)), device, dtype
    )
    progress = Progress(STAGE, len(set(whole) | set(same)), unit="samples")
    sim = offline.simulate(
        models,
        head,
        lambda sid: store.read_sample(STORE_DIR, val[sid], layers=positions),
        whole,
        e.num_speculative_tokens,
        same_ids=same,
        max_positions=e.max_new_tokens,
        on_sample=progress.advance,
        matches=matches,
        sweep=e.num_speculative_tokens_sweep,
    )
    models.clear()
    del head
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return sim


def _val_samples(
    params: Params, manifest: dict[str, Any]
) -> tuple[dict[str, dict], list[str], list[str]]:
    """(the store's val entries, the ids simulated on the whole val, the online run's prompts
    that the store holds: the like-for-like reference for vLLM)."""
    val = {sid: e for sid, e in manifest["samples"].items() if e["split"] == "val"}
    if not val:
        raise StoreError(f"{STORE_DIR}: no val samples: raise prepare.val_ratio")
    e = params.evaluate
    same = (
        [r["id"] for r in val_conversations(e.max_eval_prompts) if r["id"] in val]
        if e.online
        else []
    )
    return val, sorted(val)[: e.max_offline_samples], same


def simulate_family(
    params: Params,
    name: str,
    drafter_dir: Path,
    own: list[int],
    verifier: vf.VerifierFacts | None = None,
) -> dict[str, Any]:
    """eval.json's offline keys of a branch, simulated as its family drafts (EAGLE-3 and 3.1
    chained: evaluation.offline; DFlash and P-EAGLE one pass per draft:
    evaluation.parallel_offline) on the store's val samples and its own layers `own`."""
    verifier = verifier or vf.read_verifier(params.verifier)
    config = verifier.text
    manifest = store.read_manifest(STORE_DIR)
    positions = store.check_layout(manifest, own, verifier.num_layers, STORE_DIR)
    val, whole, same = _val_samples(params, manifest)
    path, placement = params.verifier.path, drafter.compute_placement()
    family = families.entry(params.families, name)
    if family.speculator_type == "eagle3":  # EAGLE-3 and 3.1: its flags are in its config
        models = {"trained": drafter.load_drafter(drafter_dir, path, *placement)}
        matches = offline.draft_matches
    else:
        loaded = drafter.load_parallel_drafter(drafter_dir, path, *placement, family=family.name)
        models, matches = {"trained": loaded}, parallel_offline.MATCHES[family.name]
    sim = _simulate(params, config, models, (val, positions), whole, same, matches)
    trained = sim.whole["trained"].summary()
    result: dict[str, Any] = {"offline": {"trained": trained}}
    log(
        STAGE,
        f"family {name}: simulated mean acceptance length {trained['mean_acceptance_length']:.3f}"
        f" over {trained['num_drafts']} drafts on {len(whole)} val samples (layers {own})",
    )
    if sim.same is not None:
        result["offline_same_prompts"] = draft_sweep.same_prompts(sim, params.evaluate)
    return result


def _trained_layers(
    params: Params, verifier: vf.VerifierFacts, family: str | None = None
) -> list[int]:
    """The aux layer ids (vLLM's convention) `train`'s drafter, or branch `family`'s, read."""
    if family is not None and family in params.layers.family_aux_layer_ids:
        return list(params.layers.family_aux_layer_ids[family])
    return run_conventions(params.layers, params.train, verifier.num_layers).aux_layer_ids


def val_conversations(limit: int) -> list[dict[str, Any]]:
    """The first `limit` prepared val rows (id + messages), in file order."""
    if not VAL_PROMPTS.is_file():
        raise DataError(f"{VAL_PROMPTS}: not found: run the prepare stage")
    rows = readers.read_jsonl(VAL_PROMPTS)[:limit]
    if not rows:
        raise DataError(f"{VAL_PROMPTS}: no val prompts: raise prepare.val_ratio")
    return rows


def run_online(
    params: Params,
    drafter_dir: Path = DRAFTER_DIR,
    family: str = "eagle3",
    work: Path = WORK_DIR,
    aux_layer_ids: list[int] | None = None,
    held_out: bool = False,
    verifier: vf.VerifierFacts | None = None,
) -> tuple[dict[str, Any], list[str], Verdict]:
    """Serve the verifier with and without the drafter (of `family`, served from
    `drafter_dir`, logs in `work`); (online section, differing ids, losslessness verdict).
    `aux_layer_ids`: the layers the drafter was trained on, which vLLM must have captured.
    `held_out`: evaluate.public_sets are served too (section `held_out`). `verifier`: the
    run's, read here when not given.

    `evaluate` and every `family@NAME` branch come here alike: both servers up, one full pass
    each (acceptance, losslessness), then evaluate.speedup_rounds paired rounds, the order
    alternating, at evaluate.concurrency and each of evaluate.throughput_concurrency: every
    drafter's speed-up is the median ratio against a baseline timed beside it, or none when
    its rounds spread more than evaluate.speedup_max_spread (evaluation/speedup.py)."""
    e = params.evaluate
    rows = val_conversations(e.max_eval_prompts)
    settings = measure.Settings.of(params.evaluate, params.generate.chat_template_kwargs)
    # No reasoning parser: the whole completion (reasoning included) is what the runs compare.
    verifier = verifier or vf.read_verifier(params.verifier)
    base = verifier_spec(verifier, params.vllm, work / "vllm.log")
    if e.vllm_extra_args is not None:
        base = dataclasses.replace(base, extra_args=list(e.vllm_extra_args))
    try:
        section, differing, verdict = online_eval.evaluate(
            base,
            drafter_dir,
            [r["messages"] for r in rows],
            settings,
            work,
            prompt_ids=[r["id"] for r in rows],
            start_together=e.start_servers_together,
            family=family,
            sweep=e.num_speculative_tokens_sweep,
            held_out=load_sets(
                params.evaluate, TRAIN_PROMPTS, params.prepare.synthesize.near_duplicate_jaccard
            )
            if held_out
            else (),
            answer_window=e.answer_window,
        )
    except ServerDown as exc:
        raise ServerDown(f"{exc}; {RERUN_HINT}") from None
    if aux_layer_ids is not None:
        section["served_aux_layer_ids"] = served_with.check_aux_layers(
            work / f"vllm-{family}.log", aux_layer_ids, drafter_dir, STAGE
        )
    return section, [rows[i]["id"] for i in differing], verdict
