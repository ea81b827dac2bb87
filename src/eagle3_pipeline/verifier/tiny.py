"""The tiny verifier of the tiny profiles: a seeded model and tokenizer, briefly trained.

A random-weight verifier gives a dishonest learning signal (greedy answers are repetition loops
that a drafter learns to copy), so the tiny verifier is trained briefly on committed text, with a
locally trained tokenizer (`<think>` tokens, a Kimi-style chat template). Every random choice is
seeded: the build is reproducible on one machine.
"""

from __future__ import annotations

import random
from pathlib import Path

from eagle3_pipeline.config.params import TinyVerifierParams
from eagle3_pipeline.core.errors import DataError
from eagle3_pipeline.core.progress import Progress, log
from eagle3_pipeline.core.readers import read_jsonl
from eagle3_pipeline.verifier.tiny_kimi import build_kimi_like, save_kimi_like

STAGE = "verifier"  # progress lines read as the stage that builds it

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
    for n, row in enumerate(read_jsonl(path), 1):
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

    torch.manual_seed(seed)
    if tiny.architecture == "deepseek_v3":
        return build_kimi_like(tiny, tokenizer)
    from transformers import LlamaConfig, LlamaForCausalLM

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
        tie_word_embeddings=tiny.tie_word_embeddings,
    )
    return LlamaForCausalLM(config)


ONE_CYCLE_MIN_STEPS = 40  # 5% warm-up is then >= 2 steps


def lr_schedule(opt, max_lr: float, steps: int):
    """One cycle with 5% warm-up; under ONE_CYCLE_MIN_STEPS, a linear decay from max_lr.

    torch's OneCycleLR divides by the warm-up's length in steps minus one: at 20 steps that is
    0 and it raises ZeroDivisionError, and at fewer the warm-up is negative.
    """
    import torch

    if steps >= ONE_CYCLE_MIN_STEPS:
        return torch.optim.lr_scheduler.OneCycleLR(
            opt, max_lr=max_lr, total_steps=steps, pct_start=0.05
        )
    # LambdaLR scales the lr `opt` was built with: max_lr.
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 - step / max(steps, 1))


def _train(model, stream: list[int], tiny: TinyVerifierParams, seed: int) -> tuple[float, float]:
    """A minute of AdamW on random windows of the corpus: enough for answers with structure."""
    import torch

    data = torch.tensor(stream, dtype=torch.long)
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=tiny.train_lr, weight_decay=0.0)
    steps, seq = tiny.train_steps, tiny.train_seq_len
    sched = lr_schedule(opt, tiny.train_lr, steps)
    model.train()
    first = last = float("nan")
    progress = Progress(STAGE, steps, unit="steps", every_s=10.0)
    for step in range(steps):
        starts = torch.randint(0, len(data) - seq - 1, (tiny.train_batch_size,), generator=gen)
        batch = torch.stack([data[s : s + seq + 1] for s in starts.tolist()])
        # shift_labels: the targets are already shifted (labels alone would be shifted again,
        # training the model to predict the token after next).
        target = batch[:, 1:].contiguous()
        out = model(input_ids=batch[:, :-1], labels=target, shift_labels=target)
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


PROBE_MAX_NEW_TOKENS = 96  # generate.max_new_tokens of the tiny profiles


def answer_zlib_ratio(text: str) -> float:
    """UTF-8 bytes over zlib-compressed bytes: ~1.5 for prose, far higher for loops."""
    import zlib

    raw = text.encode()
    return len(raw) / len(zlib.compress(raw, 9)) if raw else 1.0


def probe_answers(model, tokenizer, chats: list[dict], n: int) -> dict:
    """How repetitive the verifier's own greedy answers are, on the first `n` corpus questions
    asked as the generate stage asks them (thinking on): a looping verifier makes a drafter
    look good for the wrong reason (it learns to copy the loop)."""
    import torch

    ratios = []
    for row in chats[:n]:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": row["question"]}],
            add_generation_prompt=True,
            return_tensors="pt",
            return_dict=True,
        )["input_ids"]
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                max_new_tokens=PROBE_MAX_NEW_TOKENS,
                do_sample=False,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )
        ratios.append(answer_zlib_ratio(tokenizer.decode(out[0, ids.shape[1] :])))
    if not ratios:
        raise DataError("verifier.tiny.probe_answers > 0 needs chat rows in the corpus")
    return {
        "probe_answers": len(ratios),
        "answer_zlib_ratio_mean": sum(ratios) / len(ratios),
        "answer_zlib_ratio_max": max(ratios),
    }


def _token_stream(tokenizer, texts: list[str], chats: list[dict], seed: int) -> list[int]:
    docs = [t + tokenizer.eos_token for t in texts]
    docs += [tokenizer.apply_chat_template(_chat_messages(c), tokenize=False) for c in chats]
    random.Random(seed).shuffle(docs)
    stream: list[int] = []
    for d in docs:
        stream.extend(tokenizer(d, add_special_tokens=False)["input_ids"])
    return stream


def build_tiny(tiny: TinyVerifierParams, seed: int, out_dir: Path) -> dict:
    import torch

    torch.manual_seed(seed)
    texts, chats = _read_corpus(Path(tiny.corpus))
    tok_texts = texts + [f"{c['question']} {c['thinking']} {c['answer']}" for c in chats]
    tokenizer = _train_tokenizer(tok_texts, tiny.vocab_size)
    model = _build_model(tiny, tokenizer, seed)
    stream = _token_stream(tokenizer, texts, chats, seed)
    if len(stream) <= tiny.train_seq_len + 1:
        raise DataError(f"{tiny.corpus}: corpus too small for train_seq_len={tiny.train_seq_len}")
    log(
        STAGE,
        f"training tiny verifier: {sum(p.numel() for p in model.parameters()):,} params, "
        f"{len(stream):,} corpus tokens, {tiny.train_steps} steps",
    )
    first, last = _train(model, stream, tiny, seed)
    log(STAGE, f"verifier loss {first:.3f} -> {last:.3f}")
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    if tiny.architecture == "deepseek_v3":
        save_kimi_like(model, out_dir)
    else:
        model.save_pretrained(out_dir, safe_serialization=True)  # fp32: fastest on CPU
    tokenizer.save_pretrained(out_dir)
    probe: dict = {}
    if tiny.probe_answers:
        probe = probe_answers(model, tokenizer, chats, tiny.probe_answers)
        log(
            STAGE,
            f"greedy answers to {probe['probe_answers']} corpus questions compress "
            f"{probe['answer_zlib_ratio_mean']:.2f}x with zlib (max "
            f"{probe['answer_zlib_ratio_max']:.2f}x; prose ~1.5x, repetition loops far more)",
        )
    return {"loss_first": first, "loss_last": last, "corpus_tokens": len(stream)} | probe
