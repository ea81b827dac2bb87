"""Stage `generate`: the verifier answers every prepared conversation.

Training on the verifier's own answers (not on a dataset's) is what makes the drafter predict the
verifier. Reasoning and answer are kept apart, as the vLLM server's reasoning parser does.
Backends: `hf` (in-process transformers) or `vllm`: OpenAI-compatible servers, started here (one
on loopback; with `cluster.engine: ray`, one per node, each by a worker on its node) or run by the
user (`generate.server_url` or a fleet in `generate.server_urls`). Prompts are leased to the
servers (cluster/leases.py): each to one server, a lost server's prompts to the others. Servers
started here want a fresh API key per run on every route (in_vllm/auth.py); the user's get
EAGLE3_VLLM_API_KEY. Rows that fail for good go to failed.jsonl with the reason; a rerun
(`dvc repro -f generate`) retries only those.

Grows by rows: each row is keyed by its request (id, messages, tools) and the stage's settings
(`settings_key`: the generate params that decide a row, the seed, the verifier's files,
ROW_VERSION), and the key is written into the row (`row_key`). A row whose key is in the last
published data/generated (as DVC restores it: harness/published.py) or in the scratch journal
(data/.work/generate/, written by this process alone, keyed on the settings only) is not
requested again: prompts added cost only their own requests, prompts removed drop out, and the
output is the one a run from scratch writes, row for row, where each request's answer depends on
the request alone (backend vllm seeds each request by its id; backend hf seeds and pads a batch
together, so a row it made keeps the answer of the batch it was made in).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path

from eagle3_pipeline.cluster import leases
from eagle3_pipeline.cluster import record as cluster_record
from eagle3_pipeline.config.params import Params
from eagle3_pipeline.conversations import chat_template, generation_rows, turns
from eagle3_pipeline.core import atomic, paths, readers, resume
from eagle3_pipeline.core.errors import ServerError
from eagle3_pipeline.core.progress import Progress, log
from eagle3_pipeline.harness import published
from eagle3_pipeline.in_vllm import auth
from eagle3_pipeline.serving import server as vllm_server
from eagle3_pipeline.serving.chat import API_KEY_VAR, ChatClient, ChatReply
from eagle3_pipeline.serving.server_spec import SERVED_NAME, verifier_spec
from eagle3_pipeline.verifier import identity as vf
from eagle3_pipeline.verifier import loading

STAGE = "generate"
INPUT_DIR = paths.PREPARED
SPLIT_FILES = ("train.jsonl", "val.jsonl")
OUTPUT_DIR = paths.GENERATED
SERVER_LOG = paths.SCRATCH / STAGE / "server.log"
# Bump when the code that makes a row changes what the row holds: every row is made again.
ROW_VERSION = 1
# How rows are fetched, not what they contain (the verifier is keyed by its files):
# changing these keeps the journal, e.g. to finish a killed run on a teammate's server.
_NOT_FINGERPRINTED = {
    "server_url",
    "server_urls",
    "server_port",
    "concurrency",
    "max_retries",
    "request_timeout_s",
}


def _rows(params: Params) -> list[dict]:
    rows = []
    for split in ("train", "val"):
        for r in readers.read_jsonl(INPUT_DIR / f"{split}.jsonl"):
            rows.append(r | {"split": split})
    return sorted(rows, key=lambda r: r["id"])


def _generate_hf(
    params: Params,
    verifier: vf.VerifierFacts,
    batches: list[list[dict]],
    journal: resume.Journal,
    progress: Progress,
) -> None:
    """In-process transformers generation; batches are fixed slices, so resume is exact."""
    import torch

    g = params.generate
    tokenizer = loading.load_tokenizer(verifier)
    tokenizer.padding_side = "left"
    model = loading.load_model(verifier)
    ends = generation_rows.end_of_turn_ids(tokenizer, model)
    for batch in batches:
        prompts = [chat_template.render_prompt(tokenizer, r, g.chat_template_kwargs) for r in batch]
        enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
        torch.manual_seed(generation_rows.batch_seed(params.seed, [r["id"] for r in batch]))
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
            reasoning, content = (
                generation_rows.split_reasoning(text) if g.reasoning_parser else (None, text)
            )
            # the prompt's ids as the model read them: the batch's, left padding dropped
            prompt_ids = enc["input_ids"][j][enc["attention_mask"][j].bool()].tolist()
            finish = "length" if end is None else "stop"
            done.append(
                generation_rows.output_row(r, reasoning, content, finish, emitted, prompt_ids)
            )
        journal.append(done)
        progress.advance(len(batch))


def _run_hf(
    params: Params,
    verifier: vf.VerifierFacts,
    rows: list[dict],
    done: set[str],
    journal: resume.Journal,
) -> None:
    """The rows not done, in fixed batches of `batch_size` (journaled whole, in order: a killed
    run's rows left over fall into the batches it would have made)."""
    bs = params.generate.batch_size
    left = [r for r in rows if r["id"] not in done]
    todo = [left[i : i + bs] for i in range(0, len(left), bs)]
    progress = Progress(STAGE, len(rows), already_done=len(rows) - len(left))
    if todo:
        _generate_hf(params, verifier, todo, journal, progress)


def server_spec(
    params: Params, verifier: vf.VerifierFacts, log_file: Path = SERVER_LOG
) -> vllm_server.ServerSpec:
    """The verifier's server with the stage's reasoning parser."""
    return verifier_spec(
        verifier, params.vllm, log_file, reasoning_parser=params.generate.reasoning_parser
    )


def _client(params: Params, url: str, api_key: str | None) -> ChatClient:
    g = params.generate
    return ChatClient(url, g.request_timeout_s, g.max_retries, stage=STAGE, api_key=api_key)


@contextlib.contextmanager
def _servers(params: Params, verifier: vf.VerifierFacts) -> Iterator[list[leases.Server]]:
    """The servers of generate.server_url(s), or servers started here and always stopped after:
    one on loopback, or one per node with cluster.engine: ray."""
    g = params.generate
    given = g.given_servers
    if given:
        what = "the server" if len(given) == 1 else f"{len(given)} servers"
        log(
            STAGE,
            f"using {what} at {', '.join(given)} (their own reasoning parser and chat template "
            "apply)",
        )
        key = os.environ.get(API_KEY_VAR) or None
        yield [leases.Server(url, _client(params, url, key)) for url in given]
        return
    key = auth.run_key()  # this run's only
    if params.cluster.engine == "ray":
        from eagle3_pipeline.cluster import servers as node_servers

        n = params.cluster.nodes

        def spec_for(i: int, node) -> vllm_server.ServerSpec:
            spec = server_spec(params, verifier, SERVER_LOG.with_name(f"server-{i}.log"))
            spec.host, spec.api_key = node.address, key  # the node's cluster address only
            spec.port, spec.port_step = (g.server_port + i if g.server_port else None), n
            return spec

        with node_servers.node_servers(params.cluster, spec_for, params.verifier.path) as up:
            yield [leases.Server(x.node.label, _client(params, x.url, key), x.gone) for x in up]
        return
    spec = server_spec(params, verifier)
    spec.api_key, spec.port = key, g.server_port
    with vllm_server.serve(spec) as url:
        yield [leases.Server(url, _client(params, url, key))]


NO_TOKEN_IDS = (
    "the server returned no token_ids: generate trains on the ids the verifier emitted and needs "
    "a vLLM server that answers `return_token_ids` (vLLM >= 0.10.2)"
)


def _reply_row(prepared: dict, reply: ChatReply) -> dict:
    if reply.token_ids is None:
        raise ServerError(f"{prepared['id']}: {NO_TOKEN_IDS}")
    return generation_rows.output_row(
        prepared,
        reply.reasoning,
        reply.content,
        reply.finish_reason,
        reply.token_ids,
        reply.prompt_token_ids,
    )


def _log_hint(params: Params) -> str:
    if params.generate.given_servers:
        return ""
    if params.cluster.engine == "ray":
        return f"see {SERVER_LOG.with_name('server-*.log')}; "
    return f"see {SERVER_LOG}; "


def _lost_error(params: Params, servers: list[leases.Server], lost: leases.AllLost) -> ServerError:
    hint = f"{_log_hint(params)}rerun to resume: finished rows are kept"
    if len(servers) == 1:
        url = servers[0].client.base_url
        if servers[0].client.down():  # its watch's line names the server, cause and log
            return ServerError(f"{lost.last.reason}; rerun to resume: finished rows are kept")
        return ServerError(f"the server at {url} stopped answering ({lost.last.reason}); {hint}")
    return ServerError(
        f"all {len(servers)} servers were lost with {lost.unsettled} prompts unanswered (last: "
        f"{lost.last.server}: {lost.last.reason}); {hint}"
    )


def _generate_vllm(
    params: Params,
    servers: list[leases.Server],
    rows: list[dict],
    journal: resume.Journal,
    progress: Progress,
    tally: leases.Tally,
) -> list[dict]:
    """Lease every row to the servers; journal each answer as it arrives (here alone, once per
    id); return the failures {id, reason}."""
    g = params.generate
    models = {s.label: s.client.served_model(SERVED_NAME) for s in servers}
    fleet = "1 server" if len(servers) == 1 else f"{len(servers)} servers"
    log(STAGE, f"sending {len(rows)} prompts to {fleet}, {g.concurrency} in flight each")
    by_id = {r["id"]: r for r in rows}
    bodies = {
        r["id"]: generation_rows.request_body(params.generate, params.seed, SERVED_NAME, r)
        for r in rows
    }
    failed: list[dict] = []

    def advance() -> None:
        retries = sum(s.client.retries for s in servers)
        noted = failed or retries
        progress.advance(1, f"({len(failed)} failed, {retries} retries)" if noted else "")

    def on_reply(got: leases.Reply) -> None:
        journal.append([_reply_row(by_id[got.id], got.reply)])
        advance()

    def on_failed(got: leases.Failed) -> None:
        failed.append({"id": got.id, "reason": got.error})
        advance()

    def on_lost(lost: leases.Lost) -> None:
        given_up = f", {len(lost.given_up)} given up" if lost.given_up else ""
        log(
            STAGE,
            f"server {lost.server} lost ({lost.reason}): {len(lost.released)} prompts back to "
            f"the others{given_up}",
        )

    try:
        leases.run(
            servers,
            [r["id"] for r in rows],
            bodies,
            models,
            g.concurrency,
            on_reply,
            on_failed,
            on_lost,
            max_losses=params.cluster.max_attempts,
            tally=tally,
        )
    except leases.AllLost as exc:
        raise _lost_error(params, servers, exc) from None
    failed.sort(key=lambda f: f["id"])
    if failed and len(failed) == len(rows):
        first = failed[0]
        where = servers[0].client.base_url if len(servers) == 1 else f"{len(servers)} servers"
        raise ServerError(
            f"all {len(rows)} requests to {where} failed, e.g. {first['id']}: {first['reason']}; "
            f"{_log_hint(params)}fix the cause and rerun"
        )
    return failed


def _run_vllm(
    params: Params,
    rows: list[dict],
    done: set[str],
    journal: resume.Journal,
    servers: Callable[[], list[leases.Server]],
    tally: leases.Tally,
) -> list[dict]:
    """Only rows not yet journaled are requested; no server is started when none are left."""
    todo = [r for r in rows if r["id"] not in done]
    progress = Progress(STAGE, len(rows), already_done=len(rows) - len(todo))
    if not todo:
        return []
    return _generate_vllm(params, servers(), todo, journal, progress, tally)


def _rounds(
    params: Params, rows: list[dict], answers: dict[str, dict]
) -> Iterator[tuple[int, list[dict]]]:
    """(round, rows to answer): one round of every row with `turns: last`; with `every`, round k
    asks turn k of each conversation, its context the verifier's answers so far (`answers`, the
    output rows by id, filled in by the caller after each round: turns.py)."""
    if params.generate.turns == "last" or not rows:
        yield 1, rows
        return
    for k in range(1, max(turns.turn_count(r) for r in rows) + 1):
        asked = [turns.turn_row(r, k, answers) for r in rows if turns.turn_count(r) >= k]
        yield k, [r for r in asked if r is not None]


def settings_key(params: Params, verifier_stamp: str) -> str:
    """What decides every row besides its own request: the generate params but how rows are
    fetched, the seed, the verifier's files (the same stamp on every machine) and ROW_VERSION."""
    return resume.fingerprint(
        STAGE,
        ROW_VERSION,
        params.generate.model_dump(exclude=_NOT_FINGERPRINTED),
        params.seed,
        params.verifier.revision,
        verifier_stamp,  # VerifierFacts.stamp: taken once per run
    )


def row_key(settings: str, row: dict) -> str:
    """One request's key: what the request is made of (its id seeds it)."""
    return resume.row_key(settings, {k: row.get(k) for k in ("id", "messages", "tools")})


def _write_outputs(results: list[dict], failed: list[dict]) -> None:
    with atomic.replace_dir(OUTPUT_DIR) as tmp:
        for split in ("train", "val"):
            atomic.write_jsonl(tmp / f"{split}.jsonl", [r for r in results if r["split"] == split])
        atomic.write_jsonl(tmp / "failed.jsonl", failed)


def _identity_note(params: Params, servers: list[leases.Server]) -> None:
    c = params.generate.concurrency
    if len(servers) > 1 and c > 1:
        log(
            STAGE,
            f"{len(servers)} servers, generate.concurrency={c} each: rows equal a one-server "
            "run's bytes only at concurrency 1 (kernels are not batch-invariant; "
            "docs/cluster.md)",
        )


def run(params: Params) -> None:
    rows = _rows(params)
    verifier = vf.read_verifier(params.verifier)  # a clear error before anything else
    settings = settings_key(params, verifier.stamp)
    journal = resume.Journal(resume.scratch_dir(STAGE, settings) / "done.jsonl")
    earlier, where = published.keyed_rows(OUTPUT_DIR, SPLIT_FILES)
    results: dict[str, dict] = {}  # id -> output row, of every round so far
    failed: list[dict] = []
    asked: list[str] = []
    tally = leases.Tally()
    g = params.generate
    if params.cluster.engine == "ray" and g.backend == "hf":
        log(STAGE, "backend hf runs on this node only (cluster.engine: ray needs backend vllm)")
    fleet: list[list[leases.Server]] = []
    with contextlib.ExitStack() as stack:

        def servers() -> list[leases.Server]:  # started once, at the first round with work left
            if not fleet:
                fleet.append(stack.enter_context(_servers(params, verifier)))
                _identity_note(params, fleet[0])
            return fleet[0]

        for k, round_rows in _rounds(params, rows, results):
            if k > 1:
                log(STAGE, f"turn {k}: {len(round_rows)} conversations")
            round_rows = [r | {"row_key": row_key(settings, r)} for r in round_rows]
            journaled = {r["row_key"]: r for r in journal.read() if "row_key" in r}
            from_output = {r["id"] for r in round_rows if r["row_key"] in earlier}
            from_journal = {r["id"] for r in round_rows if r["row_key"] in journaled}
            reused = from_output | from_journal
            line = published.reuse_line(
                len(round_rows),
                len(round_rows) - len(reused),
                where,
                len(from_output),
                len(from_journal - from_output),
            )
            log(STAGE, line)
            asked += [r["id"] for r in round_rows]
            if g.backend == "vllm":
                failed += _run_vllm(params, round_rows, reused, journal, servers, tally)
            else:
                _run_hf(params, verifier, round_rows, reused, journal)
            journaled = {r["row_key"]: r for r in journal.read() if "row_key" in r}
            for r in round_rows:
                got = journaled.get(r["row_key"]) or earlier.get(r["row_key"])
                if got is not None:  # the split is prepare's to say, not part of the answer
                    results[r["id"]] = got | {"split": r["split"]}
    if fleet and (params.cluster.engine == "ray" or g.server_urls):
        engine = "ray" if not g.given_servers else "server_urls"
        cluster_record.write(
            STAGE, {"engine": engine, "concurrency_per_server": g.concurrency} | tally.record()
        )
    out = [results[i] for i in asked if i in results]
    failed.sort(key=lambda f: f["id"])
    _write_outputs(out, failed)
    n_reason = sum(1 for r in out if r["reasoning"])
    n_stop = sum(1 for r in out if r["finish_reason"] == "stop")
    log(
        STAGE,
        f"{len(out)} responses ({n_reason} with reasoning, {n_stop} finished, "
        f"{len(out) - n_stop} hit max_new_tokens) -> {OUTPUT_DIR}",
    )
    if failed:
        log(
            STAGE,
            f"{len(failed)} rows failed and were left out (reasons in {OUTPUT_DIR}/failed.jsonl); "
            "`dvc repro -f generate` retries only those",
        )
