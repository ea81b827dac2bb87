"""`eagle3 plan`: what a run will build and cost, from config files alone, before any GPU hour.

`make_plan` meets every check in the order a run would (params_keys.py holds the params file
against dvc.yaml, inputs.py reads, support.py checks the installed vLLM and the chat template,
checks.py refuses or warns, drafter/shape.py counts, estimates.py sizes, modes.py costs the
hidden states in both modes, nodes.py splits the work over a Ray cluster's nodes, curve_cost.py
costs the learning curve's fractions and a fitted curve of this verifier, totals.py sums GPUs,
disk and hours); report.py renders the result. On this machine a path a stage reads
that is not here is refused (support.missing_paths, the check stage's own line); a plan from
config files (--verifier-config, --init-config, or profiles/configs/ standing in for a model
folder not downloaded yet) is for the machine that will hold them and lists those paths. A
mismatch that would only surface days later (after generate and extract) stops here as one line.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from eagle3_pipeline.config.layer_ids import resolve_layer_ids, store_aux_layer_ids
from eagle3_pipeline.config.params import Params
from eagle3_pipeline.core.errors import ParamsError
from eagle3_pipeline.drafter import conventions as conv
from eagle3_pipeline.drafter.shape import (
    DrafterShape,
    ParamGroup,
    drafter_from_init,
    drafter_from_verifier,
    parameter_groups,
)
from eagle3_pipeline.plan import (
    checks,
    curve_cost,
    estimates,
    inputs,
    memory,
    modes,
    nodes,
    params_keys,
    totals,
)
from eagle3_pipeline.plan import support as vsupport
from eagle3_pipeline.verifier import identity as vf


@dataclass
class Plan:
    """Everything `eagle3 plan` prints: the checked shapes and the estimated costs."""

    profile: str
    params_path: str
    verifier: inputs.VerifierShape
    tokenizer: str
    aux_layer_ids: list[int]
    final_layer_id: int
    # What extract captures: aux_layer_ids, plus the families' own ids (their union) if any.
    store_aux_layer_ids: list[int]
    draft_vocab_size: int
    drafter: DrafterShape
    conventions: conv.RunConventions
    groups: list[ParamGroup]
    store_bytes_per_token: dict[str, int]
    tokens: estimates.TokenEstimate
    hidden_states: str  # train.hidden_states: the mode this run uses
    store_dtype: str
    online_keep_val: int | None  # val samples extract keeps in online mode (None: all)
    # Both modes' disk and prefill: the plan's own sample count first (when known), then each
    # --samples entry.
    scales: list[modes.ScaleCost]
    train_tokens: int | None
    steps_per_epoch: int | None
    total_steps: int | None
    warmup_steps: int | None
    checkpoint_weights_bytes: int
    checkpoint_optimizer_bytes: int
    epochs: int
    keep_last: int | None
    max_tokens_per_batch: int
    global_batch_tokens: int
    prompt: estimates.PromptLength
    serving: memory.ServingMemory | None
    training: memory.TrainMemory
    warnings: list[str] = field(default_factory=list)
    cluster: nodes.ClusterPlan | None = None  # each node's share (cluster.engine: ray)
    # The installed vLLM against the verifier's class, and its chat template (support.py).
    support: vsupport.VerifierSupport | None = None
    params_keys: list[str] = field(default_factory=list)  # dvc.yaml's, all in the params file
    curve: curve_cost.CurvePlan | None = None  # the learning curve's predictions, costed
    # Why no curve is costed, one line each: none fitted (--target-tau), another verifier's.
    curve_notes: list[str] = field(default_factory=list)
    fractions: curve_cost.FractionsCost | None = None  # what curve.fractions adds
    shipped: list[str] = field(default_factory=list)  # configs read from profiles/configs/
    # A plan from config files: the paths the check stage will refuse until they are there.
    not_here: list[str] = field(default_factory=list)
    summary: totals.Totals | None = None  # GPUs, disk per node and in all, hours

    @property
    def checkpoints_kept(self) -> int:
        """Epoch checkpoints on disk at most: the last keep_last plus the best one."""
        if self.keep_last is None:
            return self.epochs
        return min(self.epochs, self.keep_last + 1)

    @property
    def total_params(self) -> int:
        return sum(g.count for g in self.groups)

    @property
    def trainable_params(self) -> int:
        return sum(g.count for g in self.groups if g.trainable)

    @property
    def frozen_params(self) -> int:
        return self.total_params - self.trainable_params

    def disk_bytes(self, cost: modes.ModeCost) -> dict[str, int]:
        """The hidden states a mode keeps on disk, in each store dtype."""
        return {k: v * cost.disk_tokens for k, v in self.store_bytes_per_token.items()}


def make_plan(
    params: Params,
    params_path: str | Path = "params.yaml",
    verifier_config: str | Path | None = None,
    init_config: str | Path | None = None,
    tokens: int | None = None,
    prompts: int | None = None,
    samples: list[tuple[int, int | None]] | None = None,
    target_tau: float | None = None,
) -> Plan:
    """Every check in the order a run would meet it; raises the first mismatch as one line.

    `samples`: further (sample count, total tokens or None for the plan's mean per sample) at
    which to cost the hidden states of both modes (`--samples`). With a learning curve
    (metrics/curve.json) fitted on this verifier, its predictions and `target_tau` are costed
    too (curve_cost.py); curve.fractions' training and checkpoints are in the totals.
    """
    where = str(params_path)
    check_counts(tokens, prompts, target_tau)
    keys = params_keys.check_params_file(params_path)
    # On this machine every path a stage reads must be here (the check stage's own refusal);
    # a plan from config files is for the machine that will hold them: it lists what is not here.
    missing = vsupport.missing_paths(params, where)
    from_files = inputs.from_files(params, verifier_config, init_config)
    if missing and not from_files:
        raise missing[0]
    config, config_file, verifier_note = inputs.load_verifier_config(params, verifier_config, where)
    v = inputs.verifier_shape(config, str(config_file or f"{where} (verifier.tiny)"))
    vf.check_remote_code(config, params.verifier.trust_remote_code, v.source)
    tokenizer = checks.check_tokenizer(params, config_file)
    # Before any estimate: a verifier this vLLM cannot capture, or a template that does not
    # render, makes every number below moot (and the prompt estimate renders the template).
    required = not from_files and params.verifier.source != "tiny"  # as the check stage
    support = vsupport.check_verifier(params, config, config_file, v.source, required)
    aux, _ = resolve_layer_ids(params.layers, v.num_layers, where=where)
    store_aux = store_aux_layer_ids(params.layers, v.num_layers, where=where)
    checks.check_vocab(params, v.vocab_size, where)
    init, init_note = inputs.load_init_config(params, init_config, where)
    if init is not None:
        drafter = drafter_from_init(*init)
        checks.check_init(drafter, v, params, aux)
    # The rule train, export and evaluate apply: a mismatch with the checkpoint stops here.
    run = conv.resolve(params.layers, params.train, v.num_layers, init, where)
    aux, final = run.aux_layer_ids, run.final_layer_id
    if init is None:
        drafter = drafter_from_verifier(config, params.vocab.draft_vocab_size, run)
    groups = parameter_groups(drafter, len(aux), params.train.train_lm_head)
    weights, optimizer = estimates.checkpoint_bytes(groups, drafter)
    prompt = estimates.prompt_length(params)
    estimate = estimates.estimate_tokens(params, tokens, prompts, prompt)
    serving = memory.serving_memory(params, config, config_file, prompt.tokens)
    steps = (
        estimates.schedule(params, estimate.total) if estimate.total is not None else (None,) * 4
    )
    own = (
        modes.scale_cost(params, estimate.samples, estimate.total, "plan")
        if estimate.total is not None and estimate.samples
        else None
    )
    asked = modes.requested_scales(params, samples or [], estimate.tokens_per_sample)
    bytes_per_token = estimates.store_bytes_per_token(len(store_aux) + 1, v.hidden_size)
    mode_cost = getattr(own, params.train.hidden_states) if own is not None else None
    cluster = nodes.cluster_plan(
        params,
        samples=estimate.samples,
        tokens=estimate.total,
        prompt_tokens=prompt.tokens,
        disk_tokens=mode_cost.disk_tokens if mode_cost is not None else None,
        bytes_per_token=bytes_per_token[params.extract.store_dtype],
        train_tokens=steps[0],
        max_concurrency=serving.max_concurrency if serving is not None else None,
        verifier_bytes=serving.weights.bytes if serving is not None else None,
    )
    result = Plan(
        profile=params.profile,
        params_path=where,
        verifier=v,
        tokenizer=tokenizer,
        aux_layer_ids=aux,
        store_aux_layer_ids=store_aux,
        final_layer_id=final,
        draft_vocab_size=params.vocab.draft_vocab_size,
        drafter=drafter,
        conventions=run,
        groups=groups,
        store_bytes_per_token=bytes_per_token,
        tokens=estimate,
        hidden_states=params.train.hidden_states,
        store_dtype=params.extract.store_dtype,
        online_keep_val=modes.kept_val_samples(params),
        scales=([own] if own else []) + asked,
        train_tokens=steps[0],
        steps_per_epoch=steps[1],
        total_steps=steps[2],
        warmup_steps=steps[3],
        checkpoint_weights_bytes=weights,
        checkpoint_optimizer_bytes=optimizer,
        epochs=params.train.epochs,
        keep_last=params.train.keep_last,
        max_tokens_per_batch=params.train.max_tokens_per_batch,
        global_batch_tokens=estimates.global_batch_tokens(params),
        prompt=prompt,
        serving=serving,
        training=memory.train_memory(params, groups, drafter),
        warnings=checks.run_warnings(params, drafter, run)
        + checks.sequence_warnings(params, prompt.tokens)
        + checks.memory_warnings(serving)
        + modes.online_warnings(params, own),
        cluster=cluster,
        support=support,
        params_keys=keys,
        shipped=[n for n in (verifier_note, init_note) if n],
        not_here=[str(e) for e in missing],
    )
    result.curve, result.curve_notes = curve_cost.plan_curve(
        params, target_tau, _planned(params, config, config_file, verifier_config, verifier_note)
    )
    dtype_bytes = bytes_per_token[params.extract.store_dtype]
    curve_bytes = curve_cost.fraction_checkpoint_bytes(
        params, weights, optimizer, result.checkpoints_kept
    )
    result.summary = totals.totals(
        params,
        serving.weights if serving is not None else totals.verifier_weights(config, config_file),
        own,
        mode_cost.disk_tokens * dtype_bytes if mode_cost is not None else None,
        (weights + optimizer) * result.checkpoints_kept,
        prompt.tokens,
        steps[0],
        serving.max_concurrency if serving is not None else None,
        curve_bytes,
    )
    result.fractions = curve_cost.fractions_cost(
        params, curve_bytes, result.summary.seconds, own, dtype_bytes
    )
    return result


def check_counts(tokens: int | None, prompts: int | None, target_tau: float | None) -> None:
    """Numbers typed on the command line: a count below one or a tau of at most 1 (no draft
    token accepted) would print negative or empty sizes instead of a plan."""
    for flag, value in (("--tokens", tokens), ("--prompts", prompts)):
        if value is not None and value < 1:
            raise ParamsError(f"{flag} {value}: not a count: pass a positive whole number")
    if target_tau is not None and not target_tau > 1:
        raise ParamsError(
            f"--target-tau {target_tau:g}: a mean acceptance length is above 1 (1: no draft "
            "token accepted): pass e.g. --target-tau 2.5"
        )


def _planned(
    params: Params,
    config: dict,
    config_file: Path | None,
    override: str | Path | None,
    note: str | None,
) -> curve_cost.PlannedVerifier:
    """The verifier this plan is for, as a learning curve's record is compared with it: its
    own config.json, or a copy standing in (--verifier-config, a shipped config)."""
    v = params.verifier
    return curve_cost.PlannedVerifier(
        name_or_path=v.name or v.path,
        config_file=config_file,
        own=config_file is not None and override is None and note is None,
        shape=vf.shape_record(config),
    )
