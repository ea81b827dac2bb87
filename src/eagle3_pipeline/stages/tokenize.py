"""Stage `tokenize`: prompt ids from the serving chat template + the ids the verifier emitted.

input_ids are exactly what the verifier saw and said: the prompt rendered with the generation
prompt (chat_template.py; checked against the ids the server tokenized, where it sent them), then
the completion ids generate kept as emitted, the id that ended the turn included. The text is
never re-tokenized: a tokenizer can split the same text otherwise than the model emitted it, and a
reasoning parser strips what the model wrote. loss_mask covers the completion only.
Token frequencies of supervised train tokens feed the draft vocab.
"""

from __future__ import annotations

from collections import Counter

from eagle3_pipeline.config.params import Params
from eagle3_pipeline.conversations import chat_template
from eagle3_pipeline.core import atomic, paths, readers
from eagle3_pipeline.core.errors import DataError
from eagle3_pipeline.core.progress import log
from eagle3_pipeline.verifier import loading

STAGE = "tokenize"
INPUT_DIR = paths.GENERATED
OUTPUT_DIR = paths.TOKENIZED


def tokenize_row(tokenizer, row: dict, max_seq_len: int, template_kwargs: dict) -> dict:
    completion_ids = row.get("completion_token_ids")
    if completion_ids is None:
        raise DataError(
            f"{INPUT_DIR}: sample {row['id']!r} has no completion_token_ids (rows of an older "
            "generate): rerun generate (`dvc repro -f generate`)"
        )
    prompt = chat_template.render_prompt(tokenizer, row, template_kwargs)
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    served = row.get("prompt_token_ids")
    if served is not None and served != prompt_ids:
        pairs = enumerate(zip(served, prompt_ids, strict=False))
        at = next((i for i, (a, b) in pairs if a != b), min(len(served), len(prompt_ids)))
        raise DataError(
            f"{INPUT_DIR}: sample {row['id']!r}: the server tokenized the prompt otherwise than "
            f"the verifier's chat template renders it ({len(served)} vs {len(prompt_ids)} ids, "
            f"first difference at {at}): generate.chat_template_kwargs and the server's chat "
            "template must be the verifier's own"
        )
    input_ids = (prompt_ids + completion_ids)[:max_seq_len]
    loss_mask = ([0] * len(prompt_ids) + [1] * len(completion_ids))[:max_seq_len]
    return {"id": row["id"], "split": row["split"], "input_ids": input_ids, "loss_mask": loss_mask}


def run(params: Params) -> None:
    tokenizer = loading.load_tokenizer(params)
    kwargs = params.generate.chat_template_kwargs
    out: dict[str, list[dict]] = {}
    freq: Counter[int] = Counter()
    dropped = 0
    for split in ("train", "val"):
        rows = []
        for r in readers.read_jsonl(INPUT_DIR / f"{split}.jsonl"):
            t = tokenize_row(tokenizer, r, params.tokenize.max_seq_len, kwargs)
            if sum(t["loss_mask"]) == 0:
                dropped += 1
                continue
            rows.append(t)
            if split == "train":
                freq.update(i for i, m in zip(t["input_ids"], t["loss_mask"], strict=True) if m)
        out[split] = rows
    if not out["train"]:
        raise DataError(
            f"{INPUT_DIR}/train.jsonl: no row has supervised tokens within "
            f"tokenize.max_seq_len={params.tokenize.max_seq_len}: raise it"
        )
    with atomic.replace_dir(OUTPUT_DIR) as tmp:
        for split, rows in out.items():
            atomic.write_jsonl(tmp / f"{split}.jsonl", rows)
        atomic.write_json(tmp / "token_freq.json", {str(k): v for k, v in sorted(freq.items())})
    n_tok = sum(len(r["input_ids"]) for rows in out.values() for r in rows)
    n_sup = sum(sum(r["loss_mask"]) for rows in out.values() for r in rows)
    log(
        STAGE,
        f"{len(out['train'])} train + {len(out['val'])} val rows, {n_tok:,} tokens "
        f"({n_sup:,} supervised), {dropped} dropped without supervised tokens -> {OUTPUT_DIR}",
    )
