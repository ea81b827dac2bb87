"""Stage `synthesize`: the verifier writes its own prompts (Magpie), for a team without a prompt
set (prepare mixes them with the given prompt files: prepare.synthesized_share).

The chat template is rendered up to the opening of a user turn (a default system prompt it
inserts included); the verifier samples the user's words until the template's close of a user
turn (conversations/magpie.py). With `turns` > 1 the verifier then answers greedily and the next
user turn is sampled after that answer; the row is [user, assistant, ..., user], and generate
answers its last turn.

Reproducible, resumable, and grown by batches: prompts are sampled in fixed batches of
`batch_size` (vLLM on CPU takes no per-request seed; each call is seeded whole:
serving/sampler.py), batch i seeded by a hash of (seed, i, turn), so batch i depends on (seed, i)
and the settings alone. Which of its conversations are kept depends on the batches before it
(deduplication against the prompts kept so far is order-dependent: near_duplicates.py), so the
batches are replayed in order: filters (conversations/synthesis_filters.py) and deduplication
run again over every batch drawn, never a batch's own result alone. Each batch is keyed by its
index and the settings (`settings_key`: what a batch samples, the verifier's files,
ROW_VERSION; not `count`, `max_samples_ratio` nor `near_duplicate_jaccard`, which only decide
what is kept of the batches); every batch drawn is journaled in data/.work/synthesize/ as sampled
and published with its key in data/synthesized/batches.jsonl. At the start, batches 0, 1, ... are
taken from the last published output (as DVC restores it: harness/published.py) or the journal
while their keys match; sampling goes on from the first batch missing. A killed run, or one with
a larger `count`, thus ends with the prompts a run from scratch keeps (a smaller count keeps a
prefix of them). Batches are drawn until `count` prompts are kept, or fail in one line after
count x max_samples_ratio conversations, naming the drop counts and what to change.

Output (data/synthesized/, replaced whole): prompts.jsonl in the project's prompt format, ids
derived from the content (`syn-` + 20 hex digits of its sha256), in the order they were kept;
batches.jsonl (every batch the prompts were kept from, as sampled); stats.json (sampled, kept,
dropped by reason, a few dropped examples, seconds, prompts/s). count 0 writes an empty
prompts.jsonl and batches.jsonl and zeroed stats without reading the verifier.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import time
from collections import Counter
from typing import Any

from eagle3_pipeline.config.params import Params, SynthesizeParams
from eagle3_pipeline.conversations import magpie
from eagle3_pipeline.conversations import synthesis_filters as filters
from eagle3_pipeline.conversations.near_duplicates import NearDuplicates
from eagle3_pipeline.core import atomic, paths, resume
from eagle3_pipeline.core.errors import DataError, ParamsError
from eagle3_pipeline.core.progress import Progress, log
from eagle3_pipeline.harness import published
from eagle3_pipeline.serving import sampler as samplers
from eagle3_pipeline.verifier import identity as vf
from eagle3_pipeline.verifier import loading

STAGE = "synthesize"
OUTPUT_DIR = paths.SYNTHESIZED
PROMPTS = "prompts.jsonl"
STATS = "stats.json"
JOURNAL = "batches.jsonl"  # the scratch journal's name and the published batches'
ID_PREFIX = "syn-"
EXAMPLES = 3  # dropped turns shown per reason in stats.json
EXAMPLE_CHARS = 200
# Not what a batch samples: changing them keeps the journal (filters of the first turn and
# deduplication are replayed from it; a larger count or ratio goes on from the batches drawn).
_NOT_FINGERPRINTED = {"count", "max_samples_ratio", "near_duplicate_jaccard"}
# Bump when the code that samples a batch changes what it holds: every batch is drawn again.
ROW_VERSION = 1


def conversation_id(messages: list[dict]) -> str:
    """`syn-<20 hex>`: the sha256 of the conversation's canonical JSON (stable, content-only)."""
    canonical = json.dumps(messages, sort_keys=True, separators=(",", ":"))
    return ID_PREFIX + hashlib.sha256(canonical.encode()).hexdigest()[:20]


def batch_seed(seed: int, batch: int, turn: int, role: str) -> int:
    """The seed of one sampler call: batch `batch`'s `role` ("user" or "answer") turn `turn`."""
    digest = hashlib.sha256(f"{seed}:{batch}:{turn}:{role}".encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


class Tally:
    """Batches, replayed in order: the prompts kept, the drops by reason, what was sampled."""

    def __init__(self, s: SynthesizeParams) -> None:
        self.count = s.count
        self.dedupe = NearDuplicates(s.near_duplicate_jaccard)
        self.kept: list[list[dict]] = []
        self.dropped: Counter[str] = Counter()
        self.at_answer: Counter[str] = Counter()  # of those, drops of an answer between turns
        self.examples: dict[str, list[str]] = {}
        self.kept_by_steer: Counter[int] = Counter()  # prompts kept per system prompt
        self.sampled = self.user_turns = self.unused = self.batches = 0

    @property
    def full(self) -> bool:
        return len(self.kept) >= self.count

    def absorb(self, entry: dict[str, Any]) -> int:
        """Count one journaled batch; returns how many of its conversations were kept."""
        before = len(self.kept)
        self.batches += 1
        self.user_turns += entry["user_turns"]
        for row in entry["rows"]:
            self.sampled += 1
            if self.full:
                self.unused += 1
                continue
            users = [m["content"] for m in row["messages"] if m["role"] == "user"]
            reason = row["drop"] or self.dedupe.offer("\n".join(users))
            if reason is None:
                self.kept.append(row["messages"])
                self.kept_by_steer[entry.get("steer", 0)] += 1
                continue
            self.dropped[reason] += 1
            self.at_answer[reason] += row.get("at") == "answer"
            shown = self.examples.setdefault(reason, [])
            if len(shown) < EXAMPLES:
                shown.append((row.get("text") or "\n".join(users))[:EXAMPLE_CHARS])
        return len(self.kept) - before

    def summary(self) -> str:
        """`sampled 512, dropped 80 truncated, 3 duplicate`."""
        return f"sampled {self.sampled}, {_drops(self)}"


def run(params: Params) -> None:
    s = params.prepare.synthesize
    t0 = time.monotonic()
    if s.count == 0:
        _write([], _stats(s, Tally(s), 0.0, 0.0))
        log(STAGE, "prepare.synthesize.count is 0: no prompts synthesized")
        return
    verifier = vf.read_verifier(params.verifier)  # a clear error first when it is missing
    tokenizer = loading.load_tokenizer(verifier)
    shape = magpie.derive(tokenizer, params.generate.chat_template_kwargs)
    settings = settings_key(params, verifier.stamp)
    journal = resume.Journal(resume.scratch_dir(STAGE, settings) / JOURNAL)
    max_batches = math.ceil(s.count * s.max_samples_ratio / s.batch_size)
    system = " (after the template's default system prompt)" if shape.default_system else ""
    log(
        STAGE,
        f"user turns open with {shape.opening[-60:]!r}{system} and end at "
        f"{shape.user_close!r}; {s.count} prompts of {s.turns} user turn(s), batches of "
        f"{s.batch_size}, at most {max_batches} batches (max_samples_ratio "
        f"{s.max_samples_ratio:g})",
    )
    tally = Tally(s)
    earlier, where = published.keyed_rows(OUTPUT_DIR, (JOURNAL,))
    journaled = {e["row_key"]: e for e in journal.read() if "row_key" in e}
    drawn: list[dict[str, Any]] = []  # every batch absorbed, in order: batches.jsonl
    from_output = from_journal = 0
    while not tally.full and tally.batches < max_batches:
        key = batch_key(settings, tally.batches)
        entry = earlier.get(key) or journaled.get(key)
        if entry is None:
            break
        kept = tally.absorb(entry)
        from_output += kept if key in earlier else 0
        from_journal += 0 if key in earlier else kept
        drawn.append(entry)
    resumed, kept_before = tally.batches, min(len(tally.kept), s.count)
    from_output = min(from_output, kept_before)  # a last batch's prompts past count are unused
    line = published.reuse_line(
        s.count, s.count - kept_before, where, from_output, kept_before - from_output
    )
    log(STAGE, line)
    progress = Progress(STAGE, s.count, unit="prompts", already_done=kept_before)
    t_sampling = time.monotonic()
    batches = _BatchSampler(params, tokenizer, shape)
    with contextlib.ExitStack() as stack:
        while not tally.full and tally.batches < max_batches:
            if batches.sampler is None:  # started only when a batch is left to draw
                batches.sampler = stack.enter_context(
                    samplers.open_sampler(verifier, s, params.vllm, tokenizer)
                )
            entry = batches.sample(tally.batches) | {"row_key": batch_key(settings, tally.batches)}
            journal.append([entry])
            drawn.append(entry)
            progress.advance(tally.absorb(entry), extra=tally.summary())
    if not tally.full:
        raise DataError(_failure(s, tally))
    sampling_s = time.monotonic() - t_sampling
    seconds = time.monotonic() - t0
    rows = [{"id": conversation_id(m), "messages": m} for m in tally.kept[: s.count]]
    new = len(rows) - kept_before
    _write(rows, _stats(s, tally, seconds, new / sampling_s if new else 0.0, shape, resumed), drawn)
    rate = f" ({new / sampling_s:.1f} prompts/s sampled)" if new else " (all reused)"
    log(
        STAGE,
        f"kept {len(rows)} of {tally.sampled} sampled ({_drops(tally)}) in {seconds:.1f} s"
        f"{rate} -> {OUTPUT_DIR}",
    )


def _drops(tally: Tally) -> str:
    """`dropped 80 truncated, 3 duplicate` (or `dropped none`)."""
    return "dropped " + (", ".join(f"{n} {r}" for r, n in tally.dropped.most_common()) or "none")


class _BatchSampler:
    """Draws batch i: every user turn sampled, every answer greedy, seeded by (seed, i, turn)."""

    def __init__(self, params: Params, tokenizer: Any, shape: magpie.TurnShape) -> None:
        s = params.prepare.synthesize
        self.params, self.tokenizer, self.shape = params, tokenizer, shape
        self.sampler: samplers.Sampler | None = None
        self.openings = steered_openings(params, tokenizer, shape)
        self.markers = filters.leak_markers(tokenizer, shape.markers)
        ends = _end_ids(params, tokenizer)
        self.user = samplers.Request(
            s.max_prompt_tokens,
            s.temperature,
            s.top_p,
            (shape.user_close,),
            tuple(dict.fromkeys([*shape.user_stop_ids, *ends])),
        )
        self.answer = samplers.Request(
            s.max_answer_tokens,
            stop=(shape.answer_close,) if shape.answer_close else (),
            stop_token_ids=tuple(dict.fromkeys([*shape.answer_stop_ids, *ends])),
        )

    def sample(self, index: int) -> dict[str, Any]:
        s = self.params.prepare.synthesize
        kwargs = self.params.generate.chat_template_kwargs
        rows: list[dict[str, Any]] = [{"messages": [], "drop": None} for _ in range(s.batch_size)]
        user_turns = 0
        for turn in range(1, s.turns + 1):
            if turn > 1:
                alive = [r for r in rows if r["drop"] is None]
                prompts = [
                    magpie.answer_prompt(self.tokenizer, r["messages"], kwargs) for r in alive
                ]
                answers = self._call(prompts, self.answer, index, turn)
                for r, prompt, (text, ended) in zip(alive, prompts, answers, strict=True):
                    content = magpie.answer_content(prompt, text) if text is not None else ""
                    r["drop"] = filters.answer_problem(content, ended, self.markers)
                    if r["drop"] is None:
                        r["messages"].append({"role": "assistant", "content": content})
                    else:
                        r |= {"text": text or "", "at": "answer"}
            alive = [r for r in rows if r["drop"] is None]
            if turn == 1:
                openings = [self.openings[index % len(self.openings)]] * len(alive)
            else:
                openings = [magpie.opening(self.tokenizer, r["messages"], kwargs) for r in alive]
            user_turns += len(alive)
            turns = self._call(openings, self.user, index, turn)
            for r, (text, ended) in zip(alive, turns, strict=True):
                r["drop"] = filters.problem(text or "", ended, s.min_chars, self.markers)
                if r["drop"] is None:
                    r["messages"].append({"role": "user", "content": text.strip()})
                else:
                    r["text"] = text or ""
        entry = {"batch": index, "rows": rows, "user_turns": user_turns}
        if s.system_prompts:  # which system prompt steered it (tally.kept_by_steer)
            entry["steer"] = index % len(self.openings)
        return entry

    def _call(
        self, prompts: list[str], request: samplers.Request, index: int, turn: int
    ) -> list[tuple[str | None, bool]]:
        """(text, ended) per prompt; (None, False) for a prompt that leaves no room for
        request.max_tokens within vllm.max_model_len (later stages could not serve it)."""
        ids = [self.tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
        room = self.params.vllm.max_model_len - request.max_tokens
        fits = [j for j, p in enumerate(ids) if len(p) <= room]
        out: list[tuple[str | None, bool]] = [(None, False)] * len(ids)
        if fits:
            role = "user" if request is self.user else "answer"
            seed = batch_seed(self.params.prepare.synthesize.seed, index, turn, role)
            assert self.sampler is not None
            done = self.sampler.generate([ids[j] for j in fits], request, seed)
            for j, c in zip(fits, done, strict=True):
                out[j] = magpie.decode_turn(
                    self.tokenizer, c.token_ids, request.stop_token_ids, request.stop, c.ended
                )
        return out


def steered_openings(params: Params, tokenizer: Any, shape: magpie.TurnShape) -> list[str]:
    """The first user turn's opening after each of prepare.synthesize.system_prompts ("" = the
    template's own); [shape.opening] when there are none. Only the sampled turn is steered:
    the rows keep the user's words alone, and generate answers them as a user would ask."""
    prompts = params.prepare.synthesize.system_prompts
    if any(prompts) and not shape.system_open:
        raise ParamsError(
            f"params: prepare.synthesize.system_prompts: {params.verifier.path}'s chat template "
            "has no system role to steer with: set prepare.synthesize.system_prompts: []"
        )
    kwargs = params.generate.chat_template_kwargs
    system = [{"role": "system", "content": p} for p in prompts]
    return [
        magpie.opening(tokenizer, [m], kwargs) if m["content"] else shape.opening for m in system
    ] or [shape.opening]


def _end_ids(params: Params, tokenizer: Any) -> list[int]:
    """Ids that end a turn besides the template's close: the tokenizer's end of sequence and
    the generation config's (what vLLM and transformers stop on by themselves)."""
    ends = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    try:
        from transformers import GenerationConfig

        eos = GenerationConfig.from_pretrained(params.verifier.path).eos_token_id
    except (OSError, ValueError):  # no generation_config.json
        eos = None
    ends += list(eos) if isinstance(eos, (list, tuple)) else [eos] if eos is not None else []
    return list(dict.fromkeys(int(e) for e in ends))


def settings_key(params: Params, verifier_stamp: str) -> str:
    """What decides every batch besides its index: the synthesize params but those that only
    decide what is kept, the chat template's kwargs, the engine's settings, the verifier's files
    (the same stamp on every machine) and ROW_VERSION."""
    s = params.prepare.synthesize
    return resume.fingerprint(
        STAGE,
        ROW_VERSION,
        # no system prompts: the same keys as batches drawn before the field existed
        s.model_dump(
            exclude=_NOT_FINGERPRINTED | (set() if s.system_prompts else {"system_prompts"})
        ),
        params.generate.chat_template_kwargs,
        params.vllm.model_dump(exclude={"ready_timeout_s", "gpu_memory_gib"}),
        params.verifier.revision,
        verifier_stamp,  # VerifierFacts.stamp: taken once per run
    )


def batch_key(settings: str, batch: int) -> str:
    """Batch `batch`'s key: its index (its seeds derive from it) under the settings."""
    return resume.row_key(settings, {"batch": batch})


def _failure(s: SynthesizeParams, tally: Tally) -> str:
    top = tally.dropped.most_common(1)[0][0] if tally.dropped else None
    if top is not None and tally.at_answer[top] * 2 > tally.dropped[top]:
        top = f"answer-{top}"
    hint = {
        "answer-truncated": "raise prepare.synthesize.max_answer_tokens (most were answers "
        "between turns still open at it: with a reasoning template, reasoning that never "
        "ended; generate.chat_template_kwargs may turn reasoning off)",
        filters.TRUNCATED: "raise prepare.synthesize.max_prompt_tokens (turns still open at it)",
        filters.EMPTY: "lower prepare.synthesize.min_chars or raise temperature",
        filters.TEMPLATE_LEAK: "lower prepare.synthesize.temperature or top_p (the verifier "
        "writes template markers into its turns)",
        filters.DUPLICATE: "raise prepare.synthesize.temperature or top_p for more varied prompts",
        filters.NEAR_DUPLICATE: "raise prepare.synthesize.temperature, top_p or "
        "near_duplicate_jaccard for more varied prompts",
    }.get(top, "raise prepare.synthesize.temperature")
    return (
        f"{OUTPUT_DIR}: kept {len(tally.kept)} of prepare.synthesize.count={s.count} prompts "
        f"after {tally.sampled} conversations sampled (count x max_samples_ratio="
        f"{s.max_samples_ratio:g}); {_drops(tally)}: {hint}, or raise "
        f"max_samples_ratio or lower count (the {tally.batches} batches drawn are kept for the "
        "rerun)"
    )


def _stats(
    s: SynthesizeParams,
    tally: Tally,
    seconds: float,
    rate: float,
    shape: magpie.TurnShape | None = None,
    resumed: int = 0,
) -> dict[str, Any]:
    """stats.json: counts, drops by reason (every reason, 0 included), a few dropped turns,
    this run's seconds and the rate of prompts kept per second of sampling."""
    stats: dict[str, Any] = {
        "count": s.count,
        "kept": min(len(tally.kept), s.count),
        "sampled": tally.sampled,
        "user_turns_sampled": tally.user_turns,
        "dropped": {r: tally.dropped[r] for r in filters.REASONS},
        "dropped_at_answer": {r: n for r, n in sorted(tally.at_answer.items()) if n},
        "unused": tally.unused,  # sampled in the last batch after count was reached
        "batches": tally.batches,
        "batches_resumed": resumed,
        "seconds": round(seconds, 1),
        "prompts_per_s": round(rate, 2),
        "examples": tally.examples,
    }
    if shape is not None:
        stats |= {"opening": shape.opening, "stop": [shape.user_close]}
    if s.system_prompts:  # what each steer kept: a system prompt the verifier ignores shows
        stats["kept_by_system_prompt"] = [
            tally.kept_by_steer[i] for i in range(len(s.system_prompts))
        ]
    return stats


def _write(rows: list[dict], stats: dict[str, Any], batches: list[dict] | None = None) -> None:
    with atomic.replace_dir(OUTPUT_DIR) as tmp:
        atomic.write_jsonl(tmp / PROMPTS, rows)
        atomic.write_jsonl(tmp / JOURNAL, batches or [])
        atomic.write_json(tmp / STATS, stats)
