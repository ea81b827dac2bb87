"""Hidden states in each mode: the disk they take and the verifier prefill that computes them.

store (train.hidden_states: store): extract prefills every sample once and writes its hidden
states; train reads them. online: train asks a vLLM server for them while it trains, and
speculators asks again in every epoch; extract writes only the val samples it keeps
(extract.online_keep_val; null: all), which train reads instead of asking. So online trades
the store's disk for train.epochs prefills of every sample not on disk.

Val samples are the expected prepare.val_ratio share of the samples (the split is by id hash),
each of the mean tokens per sample.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from eagle3_pipeline.config.params import Params
from eagle3_pipeline.core.errors import ParamsError

MODES = ("store", "online")
_COUNT = re.compile(r"(\d+(?:\.\d+)?)([kmbt]?)")
_SCALE = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "t": 10**12}


@dataclass(frozen=True)
class ModeCost:
    """One mode at one scale: hidden-state tokens on disk and tokens the verifier prefills."""

    disk_samples: int
    disk_tokens: int
    prefill_tokens: int


@dataclass(frozen=True)
class ScaleCost:
    """Both modes for `samples` samples holding `tokens` tokens; `how`: where the row comes from."""

    samples: int
    tokens: int
    how: str
    val_samples: int
    store: ModeCost
    online: ModeCost

    @property
    def tokens_per_sample(self) -> int:
        return round(self.tokens / self.samples)


def kept_val_samples(params: Params) -> int | None:
    """The val samples extract keeps in online mode (None: all of them)."""
    return params.extract.online_keep_val


def scale_cost(params: Params, samples: int, tokens: int, how: str) -> ScaleCost:
    """Disk and verifier prefill of both modes for `samples` samples of `tokens` tokens."""
    val = round(samples * params.prepare.val_ratio)
    keep = kept_val_samples(params)
    kept = val if keep is None else min(keep, val)
    kept_tokens = round(kept * tokens / samples)
    epochs = params.train.epochs
    return ScaleCost(
        samples=samples,
        tokens=tokens,
        how=how,
        val_samples=val,
        store=ModeCost(samples, tokens, tokens),
        online=ModeCost(kept, kept_tokens, epochs * (tokens - kept_tokens) + kept_tokens),
    )


def parse_count(text: str) -> int:
    """A count as people write it at scale: 600000, 600k, 14.4M, 6B, 1.2T (no commas)."""
    m = _COUNT.fullmatch(text.strip().lower())
    if m is None:
        raise ParamsError(
            f"--samples: {text!r} is not a count: write digits with an optional k, M, B or T "
            "(e.g. 600k, 14.4M, 6B)"
        )
    return round(float(m.group(1)) * _SCALE[m.group(2)])


def parse_samples(text: str) -> list[tuple[int, int | None]]:
    """`--samples N[:TOKENS],...`: sample counts, each with its total tokens if given."""
    out: list[tuple[int, int | None]] = []
    for item in text.split(","):
        count, colon, tokens = item.partition(":")
        n = parse_count(count)
        if n < 1:
            raise ParamsError(f"--samples: {item!r}: at least one sample")
        total = parse_count(tokens) if colon else None
        if total is not None and total < n:
            raise ParamsError(f"--samples: {item!r}: fewer tokens than samples (at least one each)")
        out.append((n, total))
    return out


def requested_scales(
    params: Params, requests: list[tuple[int, int | None]], tokens_per_sample: float | None
) -> list[ScaleCost]:
    """One row per `--samples` entry; a count without tokens takes the plan's mean per sample."""
    rows: list[ScaleCost] = []
    for n, tokens in requests:
        if tokens is not None:
            rows.append(scale_cost(params, n, tokens, "--samples"))
            continue
        if tokens_per_sample is None:
            raise ParamsError(
                f"--samples {n}: the tokens per sample are unknown (--tokens without a prompt "
                f"count): pass --prompts N too, or write {n}:TOKENS"
            )
        rows.append(scale_cost(params, n, round(n * tokens_per_sample), "--samples"))
    return rows


def online_warnings(params: Params, plan_scale: ScaleCost | None) -> list[str]:
    """Online mode whose kept val samples are fewer than evaluate simulates on."""
    keep, asked = kept_val_samples(params), params.evaluate.max_offline_samples
    if params.train.hidden_states != "online" or keep is None:
        return []
    if asked is not None and keep >= asked:
        return []
    if plan_scale is not None and keep >= plan_scale.val_samples:
        return []
    wanted = "every val sample" if asked is None else f"{asked:,} val samples"
    return [
        f"extract.online_keep_val {keep:,} < evaluate.max_offline_samples ({wanted}): evaluate "
        f"simulates on {keep:,} only: raise extract.online_keep_val"
    ]
