"""Stage `generate`: the verifier answers every prepared conversation.

Training on the verifier's own answers (not on a dataset's) is what makes the drafter predict the
verifier. Reasoning and answer are kept apart, as the vLLM server's reasoning parser does.
Backends: `hf` (in-process transformers) or `vllm` (an OpenAI-compatible server, started here on
loopback or given by `generate.server_url`). Resumable by id: finished rows are journaled in
data/.work/generate/ and never requested again. Rows that fail for good go to failed.jsonl
with the reason; a rerun (`dvc repro -f generate`) retries only those.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable, Iterator
from typing import Any

from eagle3_pipeline import atomic, chat_template, paths, readers, resume, stage_deps, turns
from eagle3_pipeline.errors import ServerError
from eagle3_pipeline.params import Params
from eagle3_pipeline.progress import Progress, log
from eagle3_pipeline.serving import server as vllm_server
from eagle3_pipeline.serving.chat import ChatClient, ChatReply, Outcome, complete_all
from eagle3_pipeline.serving.server_spec import SERVED_NAME, verifier_spec
from eagle3_pipeline.verifier import identity as vf
from eagle3_pipeline.verifier import loading

STAGE = "generate"
INPUT_DIR = paths.PREPARED
OUTPUT_DIR = paths.GENERATED
SERVER_LOG = paths.SCRATCH / STAGE / "server.log"
# How rows are fetched, not what they contain (the verifier is fingerprinted by its config):
# changing these keeps the journal, e.g. to finish a killed run on a teammate's server.
_NOT_FINGERPRINTED = {"server_url", "concurrency", "max_retries", "request_timeout_s"}


def split_reasoning(text: str) -> tuple[str | None, str]:
    """(reasoning, content) of a completion whose prompt opened `<think>`, exactly as vLLM's
    deepseek_r1 parser splits it, so both backends write the same rows.

    A `<think>` the model emits itself restarts the reasoning (what precedes it is dropped);
    without `</think>` the whole text is reasoning that never reached an answer.
    """
    before, start, after = text.partition(chat_template.THINK_START)
    text = after if start else before
    if chat_template.THINK_END not in text:
        return text, ""
    reasoning, _, content = text.partition(chat_template.THINK_END)
    return reasoning, content


def _rows(params: Params) -> list[dict]:
    rows = []
    for split in ("train", "val"):
        for r in readers.read_jsonl(INPUT_DIR / f"{split}.jsonl"):
            rows.append(r | {"split": split})
    return sorted(rows, key=lambda r: r["id"])


def _batch_seed(seed: int, ids: list[str]) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{ids[0]}".encode()).digest()[:4], "big")


def _row_seed(seed: int, row_id: str) -> int:
    """Sampling seed of one request: reproducible, and independent of which rows share a batch."""
    return _batch_seed(seed, [row_id]) & 0x7FFFFFFF


def _row(
    prepared: dict,
    reasoning: str | None,
    content: str,
    finish_reason: str,
    completion_ids: list[int],
    prompt_ids: list[int] | None,
) -> dict:
    """The output row, the same for both backends. `completion_token_ids` are the ids the
    verifier emitted, the one that ended its turn included: what tokenize trains on, never the
    text re-tokenized (which can split differently, and loses what a reasoning parser strips).
    `prompt_token_ids`: the prompt as the server tokenized it (tokenize checks its own rendering
    against it)."""
    tools = {"tools": prepared["tools"]} if prepared.get("tools") else {}
    return {
        "id": prepared["id"],
        "split": prepared["split"],
        "messages": prepared["messages"],
        **tools,
        "reasoning": reasoning,
        "content": content,
        "finish_reason": finish_reason,
        "prompt_token_ids": prompt_ids,
        "completion_token_ids": completion_ids,
    }


def end_of_turn_ids(tokenizer, model) -> list[int]:
    """The ids that end a turn: the model's generation config (what vLLM stops on: Kimi ends
    an assistant turn with `<|im_end|>`, not the tokenizer's `[EOS]`), else the tokenizer's eos."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    return list(eos) if isinstance(eos, (list, tuple)) else [int(eos)]


def _generate_hf(
    params: Params, batches: list[list[dict]], journal: resume.Journal, progress: Progress
) -> None:
    """In-process transformers generation; batches are fixed slices, so resume is exact."""
    import torch

    g = params.generate
    tokenizer = loading.load_tokenizer(params)
    tokenizer.padding_side = "left"
    model = loading.load_model(params)
    ends = end_of_turn_ids(tokenizer, model)
    for batch in batches:
        prompts = [chat_template.render_prompt(tokenizer, r, g.chat_template_kwargs) for r in batch]
        enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
        torch.manual_seed(_batch_seed(params.seed, [r["id"] for r in batch]))
        sampling = (
            {"do_sample": True, "temperature": g.temperature, "top_p": g.top_p}
            if g.temperature > 0
            else {"do_sample": False}
        )
        with torch.no_grad():
            out = model.generate(
                **enc,
                max_new_tokens=g.max_new_tokens,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=ends,
                **sampling,
            )
        new_tokens = out[:, enc["input_ids"].shape[1] :]
        done = []
        for j, (r, toks) in enumerate(zip(batch, new_tokens.tolist(), strict=True)):
            # Emitted ids up to and including the one that ended the turn; after it, padding.
            end = next((i for i, t in enumerate(toks) if t in ends), None)
            emitted = toks if end is None else toks[: end + 1]
            text = tokenizer.decode(
                emitted if end is None else emitted[:-1], skip_special_tokens=False
            )
            # As the server: no reasoning parser, no reasoning (the whole reply is the answer).
            reasoning, content = split_reasoning(text) if g.reasoning_parser else (None, text)
            # the prompt's ids as the model read them: the batch's, left padding dropped
            prompt_ids = enc["input_ids"][j][enc["attention_mask"][j].bool()].tolist()
            finish = "length" if end is None else "stop"
            done.append(_row(r, reasoning, content, finish, emitted, prompt_ids))
        journal.append(done)
        progress.advance(len(batch))


def _run_hf(params: Params, rows: list[dict], done: set[str], journal: resume.Journal) -> None:
    """Fixed batches of `batch_size` rows; a batch with any row not done is redone whole."""
    bs = params.generate.batch_size
    batches = [rows[i : i + bs] for i in range(0, len(rows), bs)]
    todo = [b for b in batches if not all(r["id"] in done for r in b)]
    progress = Progress(STAGE, len(rows), already_done=len(rows) - sum(map(len, todo)))
    if todo:
        _generate_hf(params, todo, journal, progress)


def server_spec(params: Params) -> vllm_server.ServerSpec:
    """The verifier's server with the stage's reasoning parser."""
    return verifier_spec(params, SERVER_LOG, reasoning_parser=params.generate.reasoning_parser)


@contextlib.contextmanager
def _server(params: Params) -> Iterator[str]:
    """Base URL of generate.server_url, or of a server started here and always stopped after."""
    url = params.generate.server_url
    if url:
        log(STAGE, f"using the server at {url} (its own reasoning parser and chat template apply)")
        yield url.rstrip("/")
        return
    vf.check_remote_code(params, vf.read_config(params.verifier.path))
    with vllm_server.serve(server_spec(params)) as started:
        yield started


def request_body(params: Params, model: str, row: dict) -> dict[str, Any]:
    """One chat request with the stage's sampling settings and a per-row seed.

    `skip_special_tokens: false` keeps `</think>` in the text the reasoning parser splits: when the
    tokenizer marks it special (the tiny verifier's does), vLLM would strip it and report the whole
    answer as reasoning.
    """
    g = params.generate
    # Tools are rendered into the prompt; the reply stays raw text ("none": no tool parser).
    tools = {"tools": row["tools"], "tool_choice": "none"} if row.get("tools") else {}
    return {
        "model": model,
        "messages": row["messages"],
        **tools,
        "max_tokens": g.max_new_tokens,
        "temperature": g.temperature,
        "top_p": g.top_p,
        "seed": _row_seed(params.seed, row["id"]),
        "chat_template_kwargs": g.chat_template_kwargs,
        "skip_special_tokens": False,
        "return_token_ids": True,  # the ids tokenize trains on (and the prompt's, to check)
    }


NO_TOKEN_IDS = (
    "the server returned no token_ids: generate trains on the ids the verifier emitted and needs "
    "a vLLM server that answers `return_token_ids` (vLLM >= 0.10.2)"
)


def _reply_row(prepared: dict, reply: ChatReply) -> dict:
    if reply.token_ids is None:
        raise ServerError(f"{prepared['id']}: {NO_TOKEN_IDS}")
    return _row(
        prepared,
        reply.reasoning,
        reply.content,
        reply.finish_reason,
        reply.token_ids,
        reply.prompt_token_ids,
    )


def _log_hint(params: Params) -> str:
    return "" if params.generate.server_url else f"see {SERVER_LOG}; "


def _generate_vllm(
    params: Params, url: str, rows: list[dict], journal: resume.Journal, progress: Progress
) -> list[dict]:
    """Request every row; journal each answer as it arrives; return the failures {id, reason}."""
    g = params.generate
    client = ChatClient(url, g.request_timeout_s, g.max_retries, stage=STAGE)
    model = client.served_model(SERVED_NAME)
    by_id = {r["id"]: r for r in rows}
    failed: list[dict] = []

    def on_outcome(out: Outcome) -> None:
        if out.reply is None:
            failed.append({"id": out.id, "reason": out.error})
            if out.transient and not client.answers():
                raise ServerError(
                    f"the server at {url} stopped answering ({out.id}: {out.error}); "
                    f"{_log_hint(params)}rerun to resume: finished rows are kept"
                )
        else:
            journal.append([_reply_row(by_id[out.id], out.reply)])
        noted = failed or client.retries
        progress.advance(1, f"({len(failed)} failed, {client.retries} retries)" if noted else "")

    jobs = [(r["id"], request_body(params, model, r)) for r in rows]
    complete_all(client, jobs, g.concurrency, on_outcome)
    failed.sort(key=lambda f: f["id"])
    if failed and len(failed) == len(rows):
        first = failed[0]
        raise ServerError(
            f"all {len(rows)} requests to {url} failed, e.g. {first['id']}: {first['reason']}; "
            f"{_log_hint(params)}fix the cause and rerun"
        )
    return failed


def _run_vllm(
    params: Params,
    rows: list[dict],
    done: set[str],
    journal: resume.Journal,
    server: Callable[[], str],
) -> list[dict]:
    """Only rows not yet journaled are requested; no server is started when none are left."""
    todo = [r for r in rows if r["id"] not in done]
    progress = Progress(STAGE, len(rows), already_done=len(rows) - len(todo))
    if not todo:
        return []
    return _generate_vllm(params, server(), todo, journal, progress)


def _rounds(
    params: Params, rows: list[dict], journal: resume.Journal
) -> Iterator[tuple[int, list[dict]]]:
    """(round, rows to answer): one round of every row with `turns: last`; with `every`, round k
    asks turn k of each conversation, its context the verifier's answers so far (turns.py)."""
    if params.generate.turns == "last":
        yield 1, rows
        return
    for k in range(1, max(turns.turn_count(r) for r in rows) + 1):
        answers = {r["id"]: r for r in journal.read()}
        asked = [turns.turn_row(r, k, answers) for r in rows if turns.turn_count(r) >= k]
        yield k, [r for r in asked if r is not None]


def _fingerprint(params: Params) -> str:
    return resume.fingerprint(
        params.generate.model_dump(exclude=_NOT_FINGERPRINTED),
        params.seed,
        resume.file_sha256(INPUT_DIR / "train.jsonl"),
        resume.file_sha256(INPUT_DIR / "val.jsonl"),
        vf.files_stamp(params.verifier.path),
        stage_deps.code_sha256(STAGE),  # rows made by older code never survive a code fix
    )


def _write_outputs(results: list[dict], failed: list[dict]) -> None:
    with atomic.replace_dir(OUTPUT_DIR) as tmp:
        for split in ("train", "val"):
            atomic.write_jsonl(tmp / f"{split}.jsonl", [r for r in results if r["split"] == split])
        atomic.write_jsonl(tmp / "failed.jsonl", failed)


def run(params: Params) -> None:
    rows = _rows(params)
    vf.read_config(params.verifier.path)  # a clear error before anything else when missing
    journal = resume.Journal(resume.scratch_dir(STAGE, _fingerprint(params)) / "done.jsonl")
    failed: list[dict] = []
    asked: list[str] = []
    with contextlib.ExitStack() as stack:
        urls: list[str] = []

        def server() -> str:  # started once, at the first round with work left
            if not urls:
                urls.append(stack.enter_context(_server(params)))
            return urls[0]

        for k, round_rows in _rounds(params, rows, journal):
            if k > 1:
                log(STAGE, f"turn {k}: {len(round_rows)} conversations")
            done = {r["id"] for r in journal.read()}
            asked += [r["id"] for r in round_rows]
            if params.generate.backend == "vllm":
                failed += _run_vllm(params, round_rows, done, journal, server)
            else:
                _run_hf(params, round_rows, done, journal)
    finished = {r["id"]: r for r in journal.read()}
    results = [finished[i] for i in asked if i in finished]
    failed.sort(key=lambda f: f["id"])
    _write_outputs(results, failed)
    n_reason = sum(1 for r in results if r["reasoning"])
    n_stop = sum(1 for r in results if r["finish_reason"] == "stop")
    log(
        STAGE,
        f"{len(results)} responses ({n_reason} with reasoning, {n_stop} finished, "
        f"{len(results) - n_stop} hit max_new_tokens) -> {OUTPUT_DIR}",
    )
    if failed:
        log(
            STAGE,
            f"{len(failed)} rows failed and were left out (reasons in {OUTPUT_DIR}/failed.jsonl); "
            "`dvc repro -f generate` retries only those",
        )
