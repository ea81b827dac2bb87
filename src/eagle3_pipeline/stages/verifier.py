"""Stage `verifier`: build the tiny verifier (tiny profiles) or record a real one's identity.

A random-weight verifier gives a dishonest learning signal (greedy answers are repetition loops
that a drafter learns to copy), so the tiny verifier is trained briefly on committed text. Every
random choice is seeded: the stage is reproducible on one machine.
"""

from __future__ import annotations

import random
from pathlib import Path

from eagle3_pipeline import atomic
from eagle3_pipeline import verifier as vf
from eagle3_pipeline.errors import DataError, ParamsError
from eagle3_pipeline.params import Params, TinyVerifierParams
from eagle3_pipeline.progress import Progress, log

STAGE = "verifier"
OUTPUT_DIR = "data/verifier"

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_system|>",
    "<|im_user|>",
    "<|im_assistant|>",
    "<|im_middle|>",
    "<|im_end|>",
    "<think>",
    "</think>",
]

# Kimi-style chat template with a thinking section. The generation prompt opens `<think>` (as
# DeepSeek-R1 does) unless `thinking=false`, which closes it at once (Kimi's switch). Only the
# last assistant turn keeps its reasoning; earlier turns get an empty thinking section.
CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m.role == 'system' -%}<|im_system|>system<|im_middle|>{{ m.content }}<|im_end|>"
    "{%- elif m.role == 'user' -%}<|im_user|>user<|im_middle|>{{ m.content }}<|im_end|>"
    "{%- elif m.role == 'assistant' -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- if loop.last and m.reasoning_content -%}<think>{{ m.reasoning_content }}</think>"
    "{%- else -%}<think></think>{%- endif -%}"
    "{{ m.content }}<|im_end|>"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- if thinking is defined and not thinking -%}<think></think>{%- else -%}<think>{%- endif -%}"
    "{%- endif -%}"
)


def _read_corpus(path: Path) -> tuple[list[str], list[dict]]:
    if not path.is_file():
        raise DataError(f"{path}: corpus not found: set verifier.tiny.corpus to a committed file")
    texts, chats = [], []
    for n, row in enumerate(atomic.read_jsonl(path), 1):
        if row.get("kind") == "text":
            texts.append(row["text"])
        elif row.get("kind") == "chat":
            chats.append(row)
        else:
            raise DataError(f"{path}: line {n}: field 'kind' must be 'text' or 'chat'")
    if not texts and not chats:
        raise DataError(f"{path}: corpus is empty: add text or chat rows")
    return texts, chats


def _train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS[1:],
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    return hf_tok


def _chat_messages(row: dict) -> list[dict]:
    return [
        {"role": "user", "content": row["question"]},
        {"role": "assistant", "content": row["answer"], "reasoning_content": row["thinking"]},
    ]


def _build_model(tiny: TinyVerifierParams, tokenizer, seed: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if tiny.architecture != "llama":
        raise NotImplementedError(f"verifier.tiny.architecture={tiny.architecture}")
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=tiny.hidden_size,
        intermediate_size=tiny.intermediate_size,
        num_hidden_layers=tiny.num_hidden_layers,
        num_attention_heads=tiny.num_attention_heads,
        num_key_value_heads=tiny.num_key_value_heads,
        max_position_embeddings=tiny.max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def _train(model, stream: list[int], tiny: TinyVerifierParams, seed: int) -> tuple[float, float]:
    """A minute of AdamW on random windows of the corpus: enough for answers with structure."""
    import torch

    data = torch.tensor(stream, dtype=torch.long)
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=tiny.train_lr, weight_decay=0.0)
    steps, seq = tiny.train_steps, tiny.train_seq_len
    sched = torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=tiny.train_lr, total_steps=max(steps, 1), pct_start=0.05
    )
    model.train()
    first = last = float("nan")
    progress = Progress(STAGE, steps, unit="steps", every_s=10.0)
    for step in range(steps):
        starts = torch.randint(0, len(data) - seq - 1, (tiny.train_batch_size,), generator=gen)
        batch = torch.stack([data[s : s + seq + 1] for s in starts.tolist()])
        out = model(input_ids=batch[:, :-1], labels=batch[:, 1:].clone(), shift_labels=None)
        loss = out.loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        last = loss.item()
        if step == 0:
            first = last
        progress.advance(1, extra=f"loss {last:.3f}")
    model.eval()
    return first, last


def _token_stream(tokenizer, texts: list[str], chats: list[dict], seed: int) -> list[int]:
    docs = [t + tokenizer.eos_token for t in texts]
    docs += [tokenizer.apply_chat_template(_chat_messages(c), tokenize=False) for c in chats]
    random.Random(seed).shuffle(docs)
    stream: list[int] = []
    for d in docs:
        stream.extend(tokenizer(d, add_special_tokens=False)["input_ids"])
    return stream


def build_tiny(params: Params, out_dir: Path) -> dict:
    import torch

    tiny = params.verifier.tiny
    torch.manual_seed(params.seed)
    texts, chats = _read_corpus(Path(tiny.corpus))
    tok_texts = texts + [f"{c['question']} {c['thinking']} {c['answer']}" for c in chats]
    tokenizer = _train_tokenizer(tok_texts, tiny.vocab_size)
    model = _build_model(tiny, tokenizer, params.seed)
    stream = _token_stream(tokenizer, texts, chats, params.seed)
    if len(stream) <= tiny.train_seq_len + 1:
        raise DataError(f"{tiny.corpus}: corpus too small for train_seq_len={tiny.train_seq_len}")
    log(
        STAGE,
        f"training tiny verifier: {sum(p.numel() for p in model.parameters()):,} params, "
        f"{len(stream):,} corpus tokens, {tiny.train_steps} steps",
    )
    first, last = _train(model, stream, tiny, params.seed)
    log(STAGE, f"verifier loss {first:.3f} -> {last:.3f}")
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(out_dir, safe_serialization=True)  # fp32: fastest on CPU
    tokenizer.save_pretrained(out_dir)
    return {"loss_first": first, "loss_last": last, "corpus_tokens": len(stream)}


def run(params: Params) -> None:
    out_dir = Path(OUTPUT_DIR)
    if params.verifier.source == "pretrained":
        config = vf.read_config(params.verifier.path)
        vf.check_remote_code(params, config)
        layers, hidden, vocab = vf.shape(config)
        with atomic.replace_dir(out_dir) as tmp:
            atomic.write_json(
                tmp / "identity.json",
                vf.identity(params)
                | {"num_hidden_layers": layers, "hidden_size": hidden, "vocab_size": vocab},
            )
        log(STAGE, f"pretrained verifier {params.verifier.path}: {layers} layers, vocab {vocab}")
        return
    if Path(params.verifier.path) != out_dir:
        raise ParamsError(
            f"params.yaml: verifier.path={params.verifier.path} but a tiny verifier is built into "
            f"{OUTPUT_DIR}: set verifier.path: {OUTPUT_DIR}"
        )
    with atomic.replace_dir(out_dir) as tmp:
        stats = build_tiny(params, tmp)
        atomic.write_json(tmp / "build_stats.json", stats)
    atomic.write_json(out_dir / "identity.json", vf.identity(params))
    layers, _, vocab = vf.shape(vf.read_config(out_dir))
    log(STAGE, f"tiny verifier written to {out_dir}: {layers} layers, vocab {vocab}")
