"""Is speculative decoding lossless here? Judged the way vLLM judges itself.

vLLM's own greedy-equality tests (`check_logprobs_close`, tests/models/utils.py) let two greedy
runs diverge where each side's token is among the other side's top-k logprobs, and stop
comparing there: after a divergence the prefixes differ. Exact equality is too strict for
speculative decoding: the verifier scores drafts in one multi-token step, the baseline one token
at a time, and different kernels round differently (bf16 on GPU; the MLA path on CPU, see
docs/mla-on-cpu.md), so where the verifier's top two tokens are nearly tied either may win. What
must never happen is a divergence where the baseline was sure: a verifier accepting wrong tokens.

Three outcomes per prompt, at its first differing token:
- identical;
- near tie: each token is in the other run's top-k AND the baseline's margin (its logprob of
  its own token minus its logprob of the drafter run's token) is at most `near_tie_nats`: passes,
  recorded with position and margin;
- diverged: anything else (margin larger, a token outside the other's top-k, or no logprobs to
  tell): the run fails, naming prompt, position and margin.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

IDENTICAL, NEAR_TIES, DIVERGED = "identical", "near_ties", "diverged"
Outcome = Literal["identical", "near_ties", "diverged"]
MAX_LISTED = 20  # divergences listed in eval.json per kind


@dataclass(frozen=True)
class TokenLogprobs:
    """One generated token: its id, its logprob and the top-k (token id -> logprob)."""

    token_id: int
    logprob: float
    top: dict[int, float]


@dataclass(frozen=True)
class Divergence:
    """The first differing token of one prompt. `margin_nats` None: no logprob to measure it
    (the drafter run's token is outside the baseline's top-k, or a run sent no logprobs)."""

    prompt: str
    position: int
    baseline_token: int | None
    spec_token: int | None
    margin_nats: float | None
    near_tie: bool

    def describe(self) -> str:
        margin = "unknown" if self.margin_nats is None else f"{self.margin_nats:.3f} nats"
        return (
            f"prompt {self.prompt} at generated token {self.position} (baseline token "
            f"{self.baseline_token}, with the drafter {self.spec_token}; baseline margin {margin})"
        )


def parse_logprobs(choice: dict[str, Any]) -> list[TokenLogprobs] | None:
    """OpenAI chat `choice.logprobs.content` of a request with `return_tokens_as_token_ids`
    (tokens read `token_id:<id>`); None when the server sent none."""
    content = (choice.get("logprobs") or {}).get("content")
    if not content:
        return None

    def tid(token: str) -> int:
        return int(token.rpartition(":")[2])

    return [
        TokenLogprobs(
            tid(e["token"]),
            float(e["logprob"]),
            {tid(t["token"]): float(t["logprob"]) for t in e.get("top_logprobs") or []},
        )
        for e in content
    ]


def first_divergence(
    prompt: str,
    baseline: Sequence[int],
    spec: Sequence[int],
    baseline_lp: Sequence[TokenLogprobs] | None,
    spec_lp: Sequence[TokenLogprobs] | None,
    near_tie_nats: float,
) -> Divergence | None:
    """None when the token ids are identical, else the judged first differing position."""
    pos = next(
        (i for i, (a, b) in enumerate(zip(baseline, spec, strict=False)) if a != b),
        None if len(baseline) == len(spec) else min(len(baseline), len(spec)),
    )
    if pos is None:
        return None
    b_tok = baseline[pos] if pos < len(baseline) else None
    s_tok = spec[pos] if pos < len(spec) else None
    b_lp = baseline_lp[pos] if baseline_lp and pos < len(baseline_lp) else None
    s_lp = spec_lp[pos] if spec_lp and pos < len(spec_lp) else None
    if b_tok is None or s_tok is None or b_lp is None or s_lp is None:
        return Divergence(prompt, pos, b_tok, s_tok, None, near_tie=False)
    other = b_lp.top.get(s_tok)
    margin = None if other is None else b_lp.logprob - other
    near = (
        margin is not None
        and b_tok in s_lp.top  # vLLM's rule: each side's token in the other's top-k ...
        and margin <= near_tie_nats  # ... and here also: the baseline was not sure
    )
    return Divergence(prompt, pos, b_tok, s_tok, margin, near_tie=near)


@dataclass(frozen=True)
class Verdict:
    outcome: Outcome
    num_prompts: int
    near_ties: list[Divergence]
    diverged: list[Divergence]
    near_tie_nats: float
    top_logprobs: int

    @property
    def passed(self) -> bool:
        return self.outcome != DIVERGED

    def section(self) -> dict[str, Any]:
        """The `lossless` block of metrics/eval.json."""
        return {
            "verdict": self.outcome,
            "num_prompts": self.num_prompts,
            "num_identical": self.num_prompts - len(self.near_ties) - len(self.diverged),
            "num_near_ties": len(self.near_ties),
            "num_diverged": len(self.diverged),
            "near_tie_nats": self.near_tie_nats,
            "top_logprobs": self.top_logprobs,
            "near_tie_positions": [_row(d) for d in self.near_ties[:MAX_LISTED]],
            "diverged_positions": [_row(d) for d in self.diverged[:MAX_LISTED]],
        }


def _row(d: Divergence) -> dict[str, Any]:
    row = asdict(d)
    row.pop("near_tie")
    return row


def judge(
    prompts: Sequence[str],
    baseline: Sequence[Sequence[int]],
    spec: Sequence[Sequence[int]],
    baseline_lp: Sequence[Sequence[TokenLogprobs] | None],
    spec_lp: Sequence[Sequence[TokenLogprobs] | None],
    near_tie_nats: float,
    top_logprobs: int,
) -> Verdict:
    """The verdict over all prompts (see the module docstring)."""
    found = [
        first_divergence(p, b, s, bl, sl, near_tie_nats)
        for p, b, s, bl, sl in zip(prompts, baseline, spec, baseline_lp, spec_lp, strict=True)
    ]
    near = [d for d in found if d is not None and d.near_tie]
    sure = [d for d in found if d is not None and not d.near_tie]
    outcome: Outcome = DIVERGED if sure else NEAR_TIES if near else IDENTICAL
    return Verdict(outcome, len(prompts), near, sure, near_tie_nats, top_logprobs)


def combine(a: Verdict, b: Verdict) -> Verdict:
    """One verdict over the prompts of both (e.g. the val prompts and a public set's)."""
    near, sure = [*a.near_ties, *b.near_ties], [*a.diverged, *b.diverged]
    outcome: Outcome = DIVERGED if sure else NEAR_TIES if near else IDENTICAL
    n = a.num_prompts + b.num_prompts
    return Verdict(outcome, n, near, sure, a.near_tie_nats, a.top_logprobs)
