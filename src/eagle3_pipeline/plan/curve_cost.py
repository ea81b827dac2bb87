"""The learning curve as a plan: what curve.fractions adds to a run, and a predicted acceptance
-> samples, disk, prefill and hours.

Fractions (`fractions_cost`): each entry of curve.fractions is train's drafter trained again, as
train trains it, on that nested fraction of the same store, so the fractions add sum(F) times
train's training time (totals.py counts it as `curve_train`) and, each, its kept epoch
checkpoints plus the best and final weights it publishes; no hidden states in store mode.
Online mode writes no store for them to read (params refuse the pair at load): there a curve
would cost the store besides, which this says too.

A fitted curve (metrics/curve.json, the curve stage) is costed only when it was fitted on the
verifier this plan is for (`provenance`): the same config.json (its sha256), or, planned from a
copy of the config (profiles/configs/, --verifier-config), the same name, model type, layers,
hidden size and vocab. A curve that does not record its verifier is not costed either. Each
prediction (curve.predict_at times the data) and `--target-tau` becomes training tokens (the
fit's inverse), then samples at this run's mean tokens per training sample, the disk and
verifier prefill of both hidden-state modes (modes.scale_cost) and hours: generate + extract +
train, at this run's own throughputs (each stage's provenance duration over the tokens it
handled) where it has them, else at the reference rates of nodes.RATES (said so). Beside it,
side by side, what one more epoch and 2x the data each buy and cost from this run: train reruns
from scratch for either (the epochs set the schedule; the rows, the run's fingerprint).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3_pipeline.config.params import Params
from eagle3_pipeline.core import paths
from eagle3_pipeline.evaluation import learning_curve as lc
from eagle3_pipeline.plan import modes, nodes

# What a curve's verifier record is compared on where the config hash cannot be (a plan from a
# copy of the config), as the refusal names it.
COMPARED = {
    "name_or_path": "name",
    "model_type": "model type",
    "num_hidden_layers": "layers",
    "hidden_size": "hidden size",
    "vocab_size": "vocab",
}
RUN_CURVE = "set curve.fractions and run the curve stage"


@dataclass(frozen=True)
class Rates:
    """Tokens/s of the stages a larger data set reruns, and where the figures come from."""

    generate: float  # supervised (answer) tokens generated per second
    extract: float  # sample tokens prefilled and stored per second
    train: float  # training tokens per second (one epoch's tokens x epochs / duration)
    source: str


@dataclass(frozen=True)
class CurveRow:
    label: str
    tau: float
    interval: tuple[float, float] | None
    train_tokens: int
    scale: modes.ScaleCost
    hours: dict[str, float]  # generate, extract, train (store), train_online


@dataclass(frozen=True)
class Trade:
    """One way from this run to a better drafter: what it buys and what it costs."""

    label: str  # "+1 epoch (N)", "2x the data"
    gain: float | None  # the predicted change of mean acceptance length (None: unknown)
    buys: str  # that change as the plan says it, and where it comes from
    hours: dict[str, float]  # store, online
    reruns: str


@dataclass(frozen=True)
class CurvePlan:
    tau_now: float
    tokens_now: int
    samples_now: int
    check: dict[str, Any] | None
    rows: list[CurveRow]
    rates: Rates
    trade: list[Trade]  # one more epoch against 2x the data
    fitted_on: str = ""  # which verifier the curve was fitted on, and how that was compared
    peaks: str | None = None  # where each point's val acceptance peaked, by epoch
    notes: list[str] = field(default_factory=list)  # a target the fit never reaches


@dataclass(frozen=True)
class FractionsCost:
    """What curve.fractions adds to the run: the fractions' training and their checkpoints."""

    fractions: list[float]
    share: float  # sum(F): the fractions' training tokens over train's
    checkpoint_bytes: int  # every fraction's kept epoch checkpoints + its best and final weights
    train_s: float | None  # the fractions' training, in turn (None: sample count unknown)
    # Online mode: the store the fractions read (beyond the val samples online keeps) and the
    # extract that writes it (None: sample count unknown).
    store_bytes: int | None
    store_extract_s: float | None


@dataclass(frozen=True)
class PlannedVerifier:
    """The verifier a plan is for, as a curve's record of its own is compared with it."""

    name_or_path: str  # verifier.name, else verifier.path (as identity.identity names it)
    config_file: Path | None  # the config.json the plan read (None: a tiny one not built yet)
    own: bool  # config_file is the verifier's own (verifier.path), not a copy standing in
    shape: dict[str, Any]  # identity.shape_record of the config

    @property
    def config_sha256(self) -> str | None:
        if self.config_file is None:
            return None
        return hashlib.sha256(self.config_file.read_bytes()).hexdigest()


@dataclass(frozen=True)
class Provenance:
    same: bool
    line: str  # how it was compared (same), else the one-line refusal


def fraction_checkpoint_bytes(params: Params, weights: int, optimizer: int, kept: int) -> int:
    """Disk of every fraction: `kept` epoch checkpoints (weights + optimizer states) in its
    scratch folder, as train keeps, plus the best and final weights in models/curve/F."""
    return len(params.curve.fractions) * ((weights + optimizer) * kept + 2 * weights)


def fractions_cost(
    params: Params,
    checkpoint_bytes: int,
    seconds: dict[str, float] | None,
    own: modes.ScaleCost | None,
    bytes_per_token: int,
) -> FractionsCost | None:
    """curve.fractions' cost beside the run's own (None without fractions). `seconds`: the
    totals' stage times (their `curve_train`); `own`: the plan's scale, for the store."""
    fractions = params.curve.fractions
    if not fractions:
        return None
    store_bytes = extract_s = None
    if own is not None:
        extra = own.store.disk_tokens - own.online.disk_tokens
        n_inf = params.cluster.nodes if params.cluster.engine == "ray" else 1
        store_bytes = extra * bytes_per_token
        extract_s = extra / (nodes.rates_for(params).extract_per_node * n_inf)
    return FractionsCost(
        sorted(fractions),
        sum(fractions),
        checkpoint_bytes,
        (seconds or {}).get("curve_train"),
        store_bytes,
        extract_s,
    )


def load(path: Path | None = None) -> dict[str, Any] | None:
    """metrics/curve.json as the curve stage wrote it (fitted or not); None before a curve run."""
    path = path or paths.CURVE
    if not path.is_file():
        return None
    return json.loads(path.read_text())


def plan_curve(
    params: Params,
    target_tau: float | None,
    planned: PlannedVerifier,
    path: Path | None = None,
) -> tuple[CurvePlan | None, list[str]]:
    """(the curve at `path` (metrics/curve.json), costed, or None; the lines that say why it is
    not): no fitted curve where `--target-tau` asks for one, a curve of another verifier, or of
    an unknown one."""
    path = path or paths.CURVE
    curve = load(path)
    if curve is None or not curve.get("fit"):
        if target_tau is None:
            return None, []
        why = f"{path} not found" if curve is None else f"no fitted learning curve in {path}"
        return None, [f"target tau {target_tau:g}: {why} ({RUN_CURVE})"]
    found = provenance(curve, planned, path)
    if not found.same:
        asked = f"target tau {target_tau:g}: " if target_tau is not None else ""
        return None, [asked + found.line]
    return curve_plan(params, curve, target_tau, found.line), []


def provenance(curve: dict[str, Any], planned: PlannedVerifier, path: Path) -> Provenance:
    """Whether `curve` was fitted on the planned verifier: the config hash where the plan read
    the verifier's own config.json (or where the hashes agree), else name and shape."""
    rec = curve.get("verifier")
    refuse = f"not costed: {RUN_CURVE} on this verifier"
    if not isinstance(rec, dict) or not rec.get("config_sha256"):
        return Provenance(
            False,
            f"{path}: does not record the verifier it was fitted on (unknown provenance): not "
            "costed: rerun the curve stage (dvc repro curve), which records it",
        )
    theirs, ours = rec["config_sha256"], planned.config_sha256
    if ours is not None and theirs == ours:
        return Provenance(
            True,
            f"fitted on this verifier: {rec.get('name_or_path')}, config.json sha256 {ours[:12]} "
            f"(compared: the config hash of {planned.config_file})",
        )
    if planned.own:
        return Provenance(
            False,
            f"{path}: fitted on another verifier: config.json sha256 {theirs[:12]} there, "
            f"{(ours or '?')[:12]} at {planned.config_file} (compared: the config hash): {refuse}",
        )
    here = {"name_or_path": planned.name_or_path, **planned.shape}
    source = planned.config_file or "params (verifier.tiny, not built yet)"
    how = (
        f"compared: {', '.join(COMPARED.values())}; not the config hash: planned from "
        f"{source}, not the verifier's own config.json"
    )
    differ = [key for key in COMPARED if rec.get(key) != here.get(key)]
    if differ:
        key = differ[0]
        return Provenance(
            False,
            f"{path}: fitted on another verifier: {COMPARED[key]} {rec.get(key)} there, "
            f"{here.get(key)} here ({how}): {refuse}",
        )
    return Provenance(
        True,
        f"fitted on {here['name_or_path']} ({here['model_type']}, {here['num_hidden_layers']} "
        f"layers, hidden {here['hidden_size']}, vocab {here['vocab_size']}): this plan's "
        f"verifier ({how})",
    )


def measured_rates(params: Params, full: dict[str, Any]) -> Rates:
    """This run's tokens/s from its stages' provenance durations, else nodes.RATES' figures."""
    durations = {}
    for stage in ("generate", "extract", "train"):
        rec = paths.PROVENANCE / f"{stage}.json"
        if rec.is_file():
            durations[stage] = float(json.loads(rec.read_text()).get("duration_s") or 0)
    supervised = _supervised_tokens()
    manifest = paths.HIDDEN_STATES / "manifest.json"
    stored = json.loads(manifest.read_text()).get("num_tokens") if manifest.is_file() else None
    if all(durations.get(s) for s in ("generate", "extract", "train")) and supervised and stored:
        return Rates(
            supervised / (1 - params.prepare.val_ratio) / durations["generate"],
            stored / durations["extract"],
            full["train_tokens"] * params.train.epochs / durations["train"],
            "this run's own throughputs (metrics/provenance durations)",
        )
    ref = nodes.rates_for(params)
    decode = ref.decode_per_request * params.generate.concurrency
    return Rates(decode, ref.extract_per_node, ref.train_per_rank, ref.source)


def curve_plan(
    params: Params, curve: dict[str, Any], target_tau: float | None, fitted_on: str = ""
) -> CurvePlan:
    k = curve["num_speculative_tokens"]
    f = lc.Fit(curve["fit"]["a"], curve["fit"]["b"], k)
    full = next(p for p in curve["points"] if p["fraction"] == 1.0)
    per_sample = full["train_tokens"] / max(full["train_samples"], 1)
    rates = measured_rates(params, full)
    answer_share = _answer_share(full["train_tokens"])
    wanted = [
        (f"{p['data_multiple']:g}x data", p["tau"], tuple(p["interval"]), p["train_tokens"])
        for p in curve.get("predictions") or []
    ]
    notes = []
    if target_tau is not None:
        tokens = f.tokens_for(target_tau)
        if tokens is not None:
            wanted.append((f"tau {target_tau:g}", target_tau, None, round(tokens)))
        elif target_tau >= k + 1:
            notes.append(
                f"target tau {target_tau:g}: never reached: {k} drafts accept at most {k + 1} "
                "(evaluate.num_speculative_tokens)"
            )
        else:
            notes.append(
                f"target tau {target_tau:g}: never reached: the fitted curve does not rise "
                "with data (b <= 0)"
            )
    rows = []
    for label, tau, interval, tokens in wanted:
        samples = max(round(tokens / per_sample), 1)
        total = round(tokens / (1 - params.prepare.val_ratio))  # val samples are made too
        scale = modes.scale_cost(
            params, round(samples / (1 - params.prepare.val_ratio)), total, label
        )
        hours = {
            "generate": total * answer_share / rates.generate / 3600,
            "extract": total / rates.extract / 3600,
            "train": tokens * params.train.epochs / rates.train / 3600,
        }
        hours["train_online"] = hours["train"] + scale.online.prefill_tokens / rates.extract / 3600
        rows.append(CurveRow(label, tau, interval, tokens, scale, hours))
    return CurvePlan(
        full["tau"],
        full["train_tokens"],
        full["train_samples"],
        curve.get("check"),
        rows,
        rates,
        trade(params, curve, f, rates, full),
        fitted_on,
        _peaks(curve),
        notes,
    )


def trade(
    params: Params, curve: dict[str, Any], f: lc.Fit, rates: Rates, full: dict[str, Any]
) -> list[Trade]:
    """One more epoch against 2x the data, from this run: what each buys (predicted mean
    acceptance length) and costs (hours, both modes). train reruns from scratch for either."""
    epochs, tokens = params.train.epochs, full["train_tokens"]
    prefill = tokens / rates.extract  # online: one epoch's prefill of the training rows
    more = epochs + 1
    train_s = more * tokens / rates.train
    gain, buys = _epoch_gain(curve)
    one_more = Trade(
        f"+1 epoch ({more})",
        gain,
        buys,
        {"store": train_s / 3600, "online": (train_s + more * prefill) / 3600},
        f"train, all {more} epochs (train.epochs sets the schedule)",
    )
    two = lc.prediction_at(curve, 2.0)
    tau_two = two["tau"] if two is not None else f.tau(2 * tokens)
    bend = lc.prediction_at(curve, 2.0, "bend")
    # The line fell short at 2x in both real-model runs: beside it, the bend (learning_curve.py).
    also = f"; the bend: {bend['tau']:.3f}" if bend is not None else ""
    added = tokens / (1 - params.prepare.val_ratio)  # the added rows' tokens, val made too
    generate_s = added * _answer_share(tokens) / rates.generate
    train_s = epochs * 2 * tokens / rates.train
    double = Trade(
        "2x the data",
        tau_two - full["tau"],
        f"{tau_two - full['tau']:+.3f}: {full['tau']:.3f} -> {tau_two:.3f} (the fit{also})",
        {
            "store": (generate_s + added / rates.extract + train_s) / 3600,
            "online": (generate_s + train_s + epochs * 2 * prefill) / 3600,
        },
        "generate (+ extract) the added rows; train on all of them",
    )
    return [one_more, double]


def _epoch_gain(curve: dict[str, Any]) -> tuple[float | None, str]:
    """What one more epoch buys, read off the full run's val acceptance by epoch: at most what
    its last epoch added, nothing when it peaked before its last."""
    ep = curve.get("epochs") or {}
    taus = ep.get("tau_by_epoch") or []
    if len(taus) < 2:
        return None, "unknown: val acceptance by epoch needs 2 epochs or more"
    peak = ep["peak_epoch"] + 1
    if peak < len(taus):
        return 0.0, f"none: val peaked at epoch {peak} of {len(taus)}"
    gain = taus[-1] - taus[-2]
    return gain, f"at most {gain:+.3f} (val, teacher-forced: what epoch {len(taus)} added)"


def _peaks(curve: dict[str, Any]) -> str | None:
    """Where each point's val acceptance peaked (by epoch), the fractions' and the full run's."""
    parts = []
    for p in curve["points"]:
        ep = p.get("epochs") or {}
        taus = ep.get("tau_by_epoch") or []
        if taus:
            name = "the full run" if p["fraction"] == 1.0 else f"fraction {p['fraction']}"
            parts.append(f"{name} at epoch {ep['peak_epoch'] + 1} of {len(taus)}")
    return f"val acceptance peaks: {', '.join(parts)}" if parts else None


def _supervised_tokens() -> int | None:
    """The supervised tokens of the training rows (the vocab stage's frequencies)."""
    freq = paths.TOKEN_FREQ
    if not freq.is_file():
        return None
    return sum(int(n) for n in json.loads(freq.read_text()).values())


def _answer_share(train_tokens: int) -> float:
    """The share of a sample's tokens the verifier generates (the answer): this run's."""
    supervised = _supervised_tokens()
    return min(supervised / train_tokens, 1.0) if supervised and train_tokens else 0.8
