"""Stage `tokenize`: prompt ids from the serving chat template + the ids the verifier emitted.

input_ids are exactly what the verifier saw and said: the prompt rendered with the generation
prompt (chat_template.py; checked against the ids the server tokenized, where it sent them), then
the completion ids generate kept as emitted, the id that ended the turn included. The text is
never re-tokenized: a tokenizer can split the same text otherwise than the model emitted it, and a
reasoning parser strips what the model wrote. loss_mask covers the completion only.
Token frequencies of supervised train tokens feed the draft vocab.

Grows by rows: each row is keyed by the generated row it is made of (id, messages, tools, the
prompt's and the completion's ids) and the settings (tokenize params, chat_template_kwargs, the
verifier's files, ROW_VERSION); the key is written into the row (`row_key`), and a row whose key
is in the last published data/tokenized (as DVC restores it: harness/published.py) is copied,
not tokenized again. Rows are written in generate's order and token_freq.json counted over all
train rows, as a run from scratch writes them.
"""

from __future__ import annotations

from collections import Counter

from eagle3_pipeline.config.params import Params
from eagle3_pipeline.conversations import chat_template
from eagle3_pipeline.core import atomic, paths, readers, resume
from eagle3_pipeline.core.errors import DataError
from eagle3_pipeline.core.progress import log
from eagle3_pipeline.harness import published
from eagle3_pipeline.verifier import identity as vf
from eagle3_pipeline.verifier import loading

STAGE = "tokenize"
INPUT_DIR = paths.GENERATED
SPLIT_FILES = ("train.jsonl", "val.jsonl")
OUTPUT_DIR = paths.TOKENIZED
# Bump when the code that makes a row changes what the row holds: every row is made again.
ROW_VERSION = 1
# What a row is made of, of the generated row (its text is never re-tokenized).
_KEYED = ("id", "messages", "tools", "prompt_token_ids", "completion_token_ids")


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


def settings_key(params: Params) -> str:
    """What decides every row besides the generated row itself."""
    return resume.fingerprint(
        STAGE,
        ROW_VERSION,
        params.tokenize.model_dump(),
        params.generate.chat_template_kwargs,
        params.verifier.revision,
        vf.content_stamp(params.verifier.path),
    )


def run(params: Params) -> None:
    kwargs = params.generate.chat_template_kwargs
    settings = settings_key(params)
    earlier, where = published.keyed_rows(OUTPUT_DIR, SPLIT_FILES)
    generated = {s: readers.read_jsonl(INPUT_DIR / f"{s}.jsonl") for s in ("train", "val")}
    keys = {
        split: [resume.row_key(settings, {k: r.get(k) for k in _KEYED}) for r in rs]
        for split, rs in generated.items()
    }
    total = sum(map(len, generated.values()))
    reused = sum(1 for ks in keys.values() for k in ks if k in earlier)
    log(STAGE, published.reuse_line(total, total - reused, where, reused))
    tokenizer = loading.load_tokenizer(params.verifier) if reused < total else None
    out: dict[str, list[dict]] = {}
    freq: Counter[int] = Counter()
    dropped = 0
    for split, generated_rows in generated.items():
        rows = []
        for r, key in zip(generated_rows, keys[split], strict=True):
            if key in earlier:  # the split is prepare's to say, not part of the row's key
                t = earlier[key] | {"split": split}
            else:
                t = tokenize_row(tokenizer, r, params.tokenize.max_seq_len, kwargs)
                t["row_key"] = key
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
