"""What a run will cost: tokens in the store, its size, the optimizer schedule, checkpoint sizes.

Estimates from params, prompt files and the verifier's tokenizer and chat template where the
verifier is at hand; the store's bytes per token come from the store
format's own sizes (store/sizes.py), so the plan and extract's disk check never disagree.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from eagle3_pipeline.config.params import Params
from eagle3_pipeline.conversations.synthesis_mix import mix_counts
from eagle3_pipeline.drafter.shape import DrafterShape, ParamGroup
from eagle3_pipeline.store import sizes

# Average characters per token, used only to guess prompt length from prompt files.
CHARS_PER_TOKEN = 4
ASSUMED_PROMPT_TOKENS = 256


@dataclass(frozen=True)
class TokenEstimate:
    """Tokens of every sample (None: unknown), over how many samples, and how it was reached."""

    total: int | None
    how: list[str]
    samples: int | None = None

    @property
    def tokens_per_sample(self) -> float | None:
        """The mean; None when the count or the total is unknown."""
        if self.total is None or not self.samples:
            return None
        return self.total / self.samples


def store_bytes_per_token(n_layers: int, hidden: int) -> dict[str, int]:
    """Hidden-state bytes per token of the store, for each dtype it can be written in."""
    return {d: sizes.hidden_bytes_per_token(n_layers, hidden, d) for d in sizes.STORE_DTYPES}


def checkpoint_bytes(groups: list[ParamGroup], d: DrafterShape) -> tuple[int, int]:
    """(weights, optimizer) of one epoch checkpoint as speculators saves it.

    Weights in bf16 without verifier_lm_head/verifier_norm (never saved), plus d2t (int64) and
    t2d (bool) when the draft vocab is smaller; AdamW keeps two fp32 moments per trainable value.
    """
    saved = sum(g.count for g in groups if not g.name.startswith("verifier_"))
    mapping = 0
    if d.draft_vocab_size != d.target_vocab_size:
        mapping = d.draft_vocab_size * 8 + d.target_vocab_size
    trainable = sum(g.count for g in groups if g.trainable)
    return saved * 2 + mapping, trainable * 8


def _prompt_stats(source: Path) -> tuple[int, int] | None:
    """(prompts, characters of their messages) in a .jsonl file or directory, if readable."""
    files = [source] if source.is_file() else sorted(source.glob("*.jsonl"))
    if not files:
        return None
    count = chars = 0
    for f in files:
        for line in f.read_text(errors="replace").splitlines():
            if not line.strip():
                continue
            count += 1
            try:
                chars += sum(len(m.get("content", "")) for m in json.loads(line)["messages"])
            except (ValueError, KeyError, TypeError, AttributeError):
                chars += len(line)
    return count, chars


def _templated_prompt_tokens(params: Params, source: Path) -> tuple[int, int] | str:
    """(prompts, prompt tokens) as the server will see them: every prompt rendered with the
    verifier's own chat template (its default system prompt included) and tokenized; or why not.
    """
    from eagle3_pipeline.conversations import chat_template, formats
    from eagle3_pipeline.core.errors import PipelineError
    from eagle3_pipeline.verifier import loading

    if not (Path(params.verifier.path) / "tokenizer_config.json").is_file():
        return f"no tokenizer in {params.verifier.path}"
    try:
        rows = formats.load(source, params.prepare.trailing_assistant)
        tokenizer = loading.load_tokenizer(params.verifier)
        kwargs = params.generate.chat_template_kwargs
        total = sum(
            len(
                tokenizer(
                    chat_template.render_prompt(tokenizer, r, kwargs), add_special_tokens=False
                )["input_ids"]
            )
            for r in rows
        )
    except (PipelineError, OSError, ValueError) as exc:  # a tokenizer that needs remote code, say
        return f"{type(exc).__name__}: {str(exc)[:120]}"
    return len(rows), total


@dataclass(frozen=True)
class PromptLength:
    """Mean prompt tokens as the server will see them, and how that number was reached."""

    tokens: int
    how: str


def prompt_length(params: Params) -> PromptLength:
    """The verifier's chat template over the prompt files when both are at hand, else
    characters / CHARS_PER_TOKEN, else ASSUMED_PROMPT_TOKENS."""
    source = Path(params.prepare.prompts)
    stats = _prompt_stats(source) if source.exists() else None
    templated = _templated_prompt_tokens(params, source) if stats is not None else None
    if isinstance(templated, tuple) and templated[0]:
        n = max(1, round(templated[1] / templated[0]))
        return PromptLength(n, f"~{n:,} prompt (mean, verifier's chat template)")
    if stats is not None and stats[0]:
        n = max(1, round(stats[1] / stats[0] / CHARS_PER_TOKEN))
        return PromptLength(
            n, f"~{n:,} prompt (chars/{CHARS_PER_TOKEN}; not templated: {templated})"
        )
    return PromptLength(ASSUMED_PROMPT_TOKENS, f"{ASSUMED_PROMPT_TOKENS:,} prompt (assumed)")


def estimate_tokens(
    params: Params, tokens: int | None, prompts: int | None, prompt: PromptLength | None = None
) -> TokenEstimate:
    """Tokens of every sample: given, or prompts x min(prompt + max_new_tokens, max_seq_len).

    An upper bound: it assumes every answer runs to generate.max_new_tokens. Given tokens are
    spread over the prompt count when one is known (--prompts, the prompt files, max_prompts).
    """
    source = Path(params.prepare.prompts)
    stats = _prompt_stats(source) if source.exists() else None
    cap = params.prepare.max_prompts
    if prompts is not None:
        n, how_n = prompts, "--prompts"
    elif stats is not None:
        n, how_n = min(stats[0], cap or stats[0]), f"in {source}"
    elif cap is not None:
        n, how_n = cap, f"prepare.max_prompts; {source} not found"
    elif tokens is not None:
        return TokenEstimate(tokens, ["given (--tokens); prompt count unknown (--prompts N)"])
    else:
        return TokenEstimate(None, [f"unknown: {source} not found; pass --tokens N or --prompts N"])
    if prompts is None:
        n, how_n = _with_synthesized(params, n, how_n)
    if tokens is not None:
        how = [f"given (--tokens) over {n:,} prompts ({how_n}): {tokens / n:,.0f} per sample"]
        return TokenEstimate(tokens, how, n)
    prompt = prompt or prompt_length(params)
    max_new, max_len = params.generate.max_new_tokens, params.tokenize.max_seq_len
    per_sample = min(prompt.tokens + max_new, max_len)
    how = [
        f"{n:,} prompts ({how_n})",
        f"x min({prompt.how} + {max_new:,} new, max_seq_len {max_len:,}) = {per_sample:,} "
        "per sample",
        "(upper bound: every answer runs to generate.max_new_tokens)",
    ]
    return TokenEstimate(n * per_sample, how, n)


def _with_synthesized(params: Params, given: int, how: str) -> tuple[int, str]:
    """The prompt count once prepare mixes in prepare.synthesize.count synthesized prompts."""
    p = params.prepare
    synthesized = p.synthesize.count
    if not synthesized:
        return given, how
    if p.synthesized_share is None:
        syn, giv = synthesized, given
    else:
        syn, giv = mix_counts(synthesized, given, p.synthesized_share)
    total = syn + giv
    if p.max_prompts:
        total = min(total, p.max_prompts)
    return total, f"{giv:,} given {how} + {syn:,} the verifier writes (prepare.synthesize)"


def train_ranks(params: Params) -> int:
    """Training processes: train.nproc on each training node (one node unless cluster.engine
    is ray)."""
    return params.train.nproc * params.cluster.training_nodes


def global_batch_tokens(params: Params) -> int:
    """Tokens per optimizer step: each of the run's ranks (train_ranks) packs its own batch of
    train.max_tokens_per_batch, train.grad_accumulation times."""
    t = params.train
    return t.max_tokens_per_batch * train_ranks(params) * t.grad_accumulation


def schedule(params: Params, total_tokens: int) -> tuple[int, int, int, int]:
    """(train tokens, steps per epoch, total steps, warm-up steps) as speculators resolves them.

    One optimizer step per global batch (global_batch_tokens); warm-up is
    int(total steps x warmup_ratio).
    """
    t = params.train
    train_tokens = round(total_tokens * (1 - params.prepare.val_ratio))
    steps = math.ceil(train_tokens / global_batch_tokens(params))
    total = steps * t.epochs
    return train_tokens, steps, total, int(total * t.warmup_ratio)
