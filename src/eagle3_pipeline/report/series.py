"""The run report's summary series: what a user asks first after a run, as lists of records.

Each series is derived from files every run already commits (metrics/eval.json, the provenance
records, the store manifest), so it can be derived again at any revision or experiment: the report
never trusts a series file committed at another revision (a `dvc exp run` does not rewrite it).
The workspace's series are also written to metrics/report/*.json, which dvc.yaml's `plots:`
declares, so `dvc plots show|diff` draws the same charts.

Records are flat dicts; DVC and Vega-Lite read them as they are. Fields per series:
  served           label (held-out prompt set), value (vLLM's mean acceptance length there)
  acceptance       position (1-based), drafter, mode (offline|online), acceptance
  throughput       label (with|without drafter), value (tokens/s)
  durations        label (stage), value (seconds; None where the record has no duration_s)
  store_size       label (store folder), value (MB of safetensors files), num_tokens, num_samples
  bytes_per_token  label (dtype), value (bytes per token), layers, hidden_size
"""

from __future__ import annotations

from typing import Any

from eagle3_pipeline.core import paths

SERIES_DIR = paths.METRICS / "report"
NAMES = ("served", "acceptance", "throughput", "durations", "store_size", "bytes_per_token")
# Drafters are drawn in this order (the ones evaluate knows today); any other name follows.
DRAFTER_ORDER = ("untrained", "init", "trained")

Records = list[dict[str, Any]]


def drafter_key(name: str) -> tuple[int, str]:
    return (DRAFTER_ORDER.index(name), "") if name in DRAFTER_ORDER else (len(DRAFTER_ORDER), name)


def _per_position(drafter: str, mode: str, result: dict[str, Any]) -> Records:
    return [
        {"position": i + 1, "drafter": drafter, "mode": mode, "acceptance": float(a)}
        for i, a in enumerate(result.get("acceptance_per_position") or [])
    ]


def served(ev: dict[str, Any]) -> Records:
    """The headline: vLLM's mean acceptance length per held-out prompt set (eval.json
    `served`), the val prompts first."""
    sets = (ev.get("served") or {}).get("sets") or {}
    return [
        {"label": name, "value": float(got["mean_acceptance_length"])} for name, got in sets.items()
    ]


def acceptance(ev: dict[str, Any]) -> Records:
    """Per draft position, every drafter eval.json holds: offline ones, then online.

    Online is the trained drafter served by vLLM (one result), or one result per drafter when
    eval.json's `online` maps drafter names to results.
    """
    rows: Records = []
    offline = ev.get("offline") or {}
    for name in sorted(offline, key=drafter_key):
        if isinstance(offline[name], dict):
            rows += _per_position(name, "offline", offline[name])
    online = ev.get("online") or {}
    if "acceptance_per_position" in online:
        rows += _per_position("trained", "online", online)
    else:
        for name in sorted(online, key=drafter_key):
            if isinstance(online[name], dict) and "acceptance_per_position" in online[name]:
                rows += _per_position(name, "online", online[name])
    return rows


def throughput(ev: dict[str, Any]) -> Records:
    """Output tokens/s of the verifier served by vLLM, without and with the drafter."""
    online = ev.get("online") or {}
    pairs = (("without drafter", "tokens_per_s_baseline"), ("with drafter", "tokens_per_s"))
    return [
        {"label": label, "value": float(online[key])}
        for label, key in pairs
        if online.get(key) is not None
    ]


def durations(records: dict[str, dict[str, Any]]) -> Records:
    """One row per stage that left a provenance record, in the order the stages finished."""
    ordered = sorted(records.items(), key=lambda kv: str(kv[1].get("recorded_at", "")))
    return [
        {
            "label": stage,
            "value": None if rec.get("duration_s") is None else float(rec["duration_s"]),
            "recorded_at": rec.get("recorded_at"),
        }
        for stage, rec in ordered
    ]


def store_size(manifest: dict[str, Any]) -> Records:
    """The hidden-state store's size: the bytes its manifest lists, in MB (1e6 bytes)."""
    samples = manifest.get("samples") or {}
    total = sum(int(entry.get("bytes", 0)) for entry in samples.values())
    return [
        {
            "label": paths.HIDDEN_STATES.as_posix(),
            "value": total / 1e6,
            "num_tokens": manifest.get("num_tokens"),
            "num_samples": manifest.get("num_samples", len(samples)),
        }
    ]


def bytes_per_token(manifest: dict[str, Any]) -> Records:
    """Bytes the store spends per token (all stored layers), as its manifest declares."""
    if manifest.get("bytes_per_token") is None:
        return []
    return [
        {
            "label": str(manifest.get("dtype", "?")),
            "value": float(manifest["bytes_per_token"]),
            "layers": len(manifest.get("layer_ids") or []),
            "hidden_size": manifest.get("hidden_size"),
        }
    ]


def derive(
    ev: dict[str, Any] | None,
    provenance: dict[str, dict[str, Any]],
    manifest: dict[str, Any] | None,
) -> dict[str, Records]:
    """Every summary series from one revision's raw files (None: the file is absent there)."""
    return {
        "served": served(ev) if ev else [],
        "acceptance": acceptance(ev) if ev else [],
        "throughput": throughput(ev) if ev else [],
        "durations": durations(provenance),
        "store_size": store_size(manifest) if manifest else [],
        "bytes_per_token": bytes_per_token(manifest) if manifest else [],
    }
