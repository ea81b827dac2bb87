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
from collections.abc import Iterator
from typing import Any

from eagle3_pipeline import atomic, chat_template, paths, readers, resume, stage_deps
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


def _row(prepared: dict, reasoning: str | None, content: str, finish_reason: str) -> dict:
    """The output row, the same for both backends."""
    tools = {"tools": prepared["tools"]} if prepared.get("tools") else {}
    return {
        "id": prepared["id"],
        "split": prepared["split"],
        "messages": prepared["messages"],
        **tools,
        "reasoning": reasoning,
        "content": content,
        "finish_reason": finish_reason,
    }


def _generate_hf(
    params: Params, batches: list[list[dict]], journal: resume.Journal, progress: Progress
) -> None:
    """In-process transformers generation; batches are fixed slices, so resume is exact."""
    import torch

    g = params.generate
    tokenizer = loading.load_tokenizer(params)
    tokenizer.padding_side = "left"
    model = loading.load_model(params)
    eos = tokenizer.eos_token
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
                eos_token_id=tokenizer.eos_token_id,
                **sampling,
            )
        new_tokens = out[:, enc["input_ids"].shape[1] :]
        done = []
        for r, toks in zip(batch, new_tokens.tolist(), strict=True):
            text = tokenizer.decode(toks, skip_special_tokens=False)
            finished = eos in text
            text = text.split(eos, 1)[0].replace(tokenizer.pad_token, "")
            # As the server: no reasoning parser, no reasoning (the whole reply is the answer).
            reasoning, content = split_reasoning(text) if g.reasoning_parser else (None, text)
            done.append(_row(r, reasoning, content, "stop" if finished else "length"))
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
    }


def _reply_row(prepared: dict, reply: ChatReply) -> dict:
    return _row(prepared, reply.reasoning, reply.content, reply.finish_reason)


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
    params: Params, rows: list[dict], done: set[str], journal: resume.Journal
) -> list[dict]:
    """Only rows not yet journaled are requested; no server is started when none are left."""
    todo = [r for r in rows if r["id"] not in done]
    progress = Progress(STAGE, len(rows), already_done=len(rows) - len(todo))
    if not todo:
        return []
    with _server(params) as url:
        return _generate_vllm(params, url, todo, journal, progress)


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
    done = {r["id"] for r in journal.read()}
    failed: list[dict] = []
    if params.generate.backend == "vllm":
        failed = _run_vllm(params, rows, done, journal)
    else:
        _run_hf(params, rows, done, journal)
    finished = {r["id"]: r for r in journal.read()}
    results = [finished[r["id"]] for r in rows if r["id"] in finished]
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
