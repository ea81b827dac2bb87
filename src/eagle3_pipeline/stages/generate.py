"""Stage `generate`: the verifier answers every prepared conversation.

Training on the verifier's own answers (not on a dataset's) is what makes the drafter predict the
verifier. Reasoning and answer are kept apart, as the vLLM server's reasoning parser does.
Resumable by id: finished batches are journaled in data/.work/generate/ and never redone.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from eagle3_pipeline import atomic, resume
from eagle3_pipeline import verifier as vf
from eagle3_pipeline.params import Params
from eagle3_pipeline.progress import Progress, log

STAGE = "generate"
INPUT_DIR = Path("data/prepared")
OUTPUT_DIR = Path("data/generated")
THINK_END = "</think>"


def split_reasoning(text: str) -> tuple[str | None, str]:
    """(reasoning, content) of a completion whose prompt opened `<think>`.

    Without `</think>` the whole text is reasoning that never reached an answer, as vLLM's
    deepseek_r1 parser reports it.
    """
    if THINK_END not in text:
        return text, ""
    reasoning, content = text.split(THINK_END, 1)
    return reasoning, content


def _rows(params: Params) -> list[dict]:
    rows = []
    for split in ("train", "val"):
        for r in atomic.read_jsonl(INPUT_DIR / f"{split}.jsonl"):
            rows.append(r | {"split": split})
    return sorted(rows, key=lambda r: r["id"])


def _batch_seed(seed: int, ids: list[str]) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{ids[0]}".encode()).digest()[:4], "big")


def _generate_hf(
    params: Params, batches: list[list[dict]], journal: resume.Journal, progress: Progress
) -> None:
    """In-process transformers generation; batches are fixed slices, so resume is exact."""
    import torch

    g = params.generate
    tokenizer = vf.load_tokenizer(params)
    tokenizer.padding_side = "left"
    model = vf.load_model(params)
    eos = tokenizer.eos_token
    for batch in batches:
        prompts = [
            tokenizer.apply_chat_template(
                r["messages"],
                tokenize=False,
                add_generation_prompt=True,
                **g.chat_template_kwargs,
            )
            for r in batch
        ]
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
            reasoning, content = split_reasoning(text)
            done.append(
                {
                    "id": r["id"],
                    "split": r["split"],
                    "messages": r["messages"],
                    "reasoning": reasoning,
                    "content": content,
                    "finish_reason": "stop" if finished else "length",
                }
            )
        journal.append(done)
        progress.advance(len(batch))


def run(params: Params) -> None:
    rows = _rows(params)
    key = resume.fingerprint(
        params.generate.model_dump(),
        params.seed,
        resume.file_sha256(INPUT_DIR / "train.jsonl"),
        resume.file_sha256(INPUT_DIR / "val.jsonl"),
        vf.config_sha256(params.verifier.path),
    )
    work = resume.scratch_dir(STAGE, key)
    journal = resume.Journal(work / "done.jsonl")
    done = {r["id"]: r for r in journal.read()}
    bs = params.generate.batch_size
    batches = [rows[i : i + bs] for i in range(0, len(rows), bs)]
    todo = [b for b in batches if not all(r["id"] in done for r in b)]
    progress = Progress(STAGE, len(rows), already_done=len(rows) - sum(map(len, todo)))
    if todo:
        _generate_hf(params, todo, journal, progress)
        done = {r["id"]: r for r in journal.read()}
    results = [done[r["id"]] for r in rows]
    with atomic.replace_dir(OUTPUT_DIR) as tmp:
        for split in ("train", "val"):
            atomic.write_jsonl(tmp / f"{split}.jsonl", [r for r in results if r["split"] == split])
        atomic.write_jsonl(tmp / "failed.jsonl", [])
    n_reason = sum(1 for r in results if r["reasoning"])
    n_stop = sum(1 for r in results if r["finish_reason"] == "stop")
    log(
        STAGE,
        f"{len(results)} responses ({n_reason} with reasoning, {n_stop} finished, "
        f"{len(results) - n_stop} hit max_new_tokens) -> {OUTPUT_DIR}",
    )
