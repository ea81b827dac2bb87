"""Stage `verifier`: build the tiny verifier (tiny profiles) or record a real one's identity.

A random-weight verifier gives a dishonest learning signal (greedy answers are repetition loops
that a drafter learns to copy), so the tiny verifier is trained briefly on committed text. Every
random choice is seeded: the stage is reproducible on one machine.
"""

from __future__ import annotations

import random
from pathlib import Path

from eagle3_pipeline import atomic, paths
from eagle3_pipeline import verifier as vf
from eagle3_pipeline.errors import DataError, ParamsError
from eagle3_pipeline.params import Params, TinyVerifierParams
from eagle3_pipeline.progress import Progress, log

STAGE = "verifier"
OUTPUT_DIR = str(paths.VERIFIER)

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

    torch.manual_seed(seed)
    if tiny.architecture == "deepseek_v3":
        return _build_kimi_like(tiny, tokenizer)
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


# DeepSeek-V3 text model, Kimi-K2.5's shape in miniature. vLLM's CPU MLA kernel needs
# kv_lora_rank + qk_rope_head_dim == 576, so those two keep DeepSeek-V3's real values; the MoE
# keeps its structure (1 dense layer first, routed experts + 1 shared, sigmoid routing with the
# e_score_correction_bias of noaux_tc) at a size derived from the tiny params.
MLA_KV_LORA_RANK = 512
MLA_ROPE_HEAD_DIM = 64
MOE_ROUTED_EXPERTS = 8
MOE_EXPERTS_PER_TOKEN = 2
# The smallest MoonViT tower Kimi_K25Config accepts: the weights must exist for transformers to
# load the wrapper, and vLLM skips the tower when images are disabled (vision_chunk: 0).
TINY_VISION = {
    "patch_size": 14,
    "num_hidden_layers": 1,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 2,
    "pos_emb_height": 8,
    "pos_emb_width": 8,
}
# vLLM's Kimi-K2.5 processor reads this file even when images are disabled; these are the
# values of the real model's preprocessor_config.json.
KIMI_MEDIA_PROC_CFG = {
    "in_patch_limit": 16384,
    "patch_size": 14,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "merge_kernel_size": 2,
    "fixed_output_tokens": None,
    "patch_limit_on_one_side": 512,
    "in_patch_limit_each_frame": 4096,
    "in_patch_limit_video": None,
    "sample_fps": 2.0,
    "max_num_frames_each_video": None,
    "temporal_merge_kernel_size": 4,
    "timestamp_mode": "hh:mm:ss.fff",
    "config_type": "image",
}


def _build_kimi_like(tiny: TinyVerifierParams, tokenizer):
    """Kimi-K2.5's layout: a DeepSeek-V3 language model under `text_config` of a multimodal
    wrapper (transformers' own Kimi_K25 classes: no remote code)."""
    from transformers import DeepseekV3Config
    from transformers.models.kimi_k25 import Kimi_K25Config, Kimi_K25ForConditionalGeneration

    head_dim = tiny.hidden_size // tiny.num_attention_heads
    text = DeepseekV3Config(
        vocab_size=len(tokenizer),
        hidden_size=tiny.hidden_size,
        intermediate_size=tiny.intermediate_size,
        moe_intermediate_size=max(tiny.intermediate_size // 4, 8),
        num_hidden_layers=tiny.num_hidden_layers,
        num_attention_heads=tiny.num_attention_heads,
        num_key_value_heads=tiny.num_attention_heads,  # MLA: one latent, every head reads it
        n_shared_experts=1,
        n_routed_experts=MOE_ROUTED_EXPERTS,
        num_experts_per_tok=MOE_EXPERTS_PER_TOKEN,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        kv_lora_rank=MLA_KV_LORA_RANK,
        q_lora_rank=tiny.hidden_size // 2,
        qk_rope_head_dim=MLA_ROPE_HEAD_DIM,
        qk_nope_head_dim=head_dim,
        v_head_dim=head_dim,
        max_position_embeddings=tiny.max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    n = len(tokenizer)  # media placeholders outside the text vocab: no text token collides
    config = Kimi_K25Config(
        text_config=text.to_dict(),
        vision_config=TINY_VISION,
        projection_hidden_size=TINY_VISION["hidden_size"],
        image_token_id=n,
        video_token_id=n + 1,
        vision_start_token_id=n + 2,
        vision_end_token_id=n + 3,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return Kimi_K25ForConditionalGeneration(config)


def _save_kimi_like(model, out_dir: Path) -> None:
    """Write the wrapper as Kimi-K2.5's checkpoint is laid out on the hub, which vLLM loads.

    transformers 5.19 reverses its Kimi weight renames imperfectly on save (decoder layers come
    out as `language_model.model.blocks.*`, the projector norm under `model.`); the hub names
    are restored here and the file is read back through transformers to prove it loads as built.
    config.json gets what transformers does not write but vLLM needs: `topk_method: noaux_tc`
    and `scoring_func: sigmoid` (what transformers' DeepSeek-V3 computes; vLLM would otherwise
    default to softmax routing) and vLLM's architecture name for the wrapper.
    """
    import json
    import re

    import torch
    from safetensors.torch import load_file, save_file

    model.save_pretrained(out_dir, safe_serialization=True)
    weights_file = out_dir / "model.safetensors"
    renames = [
        (re.compile(r"^language_model\.model\.blocks\."), "language_model.model.layers."),
        (re.compile(r"^model\.mm_projector\."), "mm_projector."),
    ]
    tensors = {}
    for key, value in load_file(weights_file).items():
        for pattern, repl in renames:
            key = pattern.sub(repl, key)
        tensors[key] = value
    save_file(tensors, weights_file, metadata={"format": "pt"})
    cfg_file = out_dir / "config.json"
    config = json.loads(cfg_file.read_text())
    config["architectures"] = ["KimiK25ForConditionalGeneration"]
    # Kimi-K2.5's own key (read by vLLM's EAGLE-3 proposer for Kimi targets), = image_token_id.
    config["media_placeholder_token_id"] = config["image_token_id"]
    config["text_config"] |= {
        "architectures": ["DeepseekV3ForCausalLM"],
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "dtype": config.get("dtype", "float32"),
    }
    atomic.write_json(cfg_file, config)
    atomic.write_json(out_dir / "preprocessor_config.json", {"media_proc_cfg": KIMI_MEDIA_PROC_CFG})
    reloaded = type(model).from_pretrained(out_dir, dtype=torch.float32).eval()
    probe = torch.arange(3, 35).unsqueeze(0) % model.config.text_config.vocab_size
    with torch.no_grad():
        if not torch.allclose(reloaded(input_ids=probe).logits, model(input_ids=probe).logits):
            raise DataError(f"{out_dir}: the saved verifier does not reload as built")


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
    if tiny.architecture == "deepseek_v3":
        _save_kimi_like(model, out_dir)
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


def _print_plan(params: Params) -> None:
    """`eagle3 plan` as the first thing `dvc repro` runs: a layer id, vocab or init checkpoint
    that does not fit the verifier stops the pipeline here, before any GPU hour."""
    from eagle3_pipeline.plan import plan, report

    print(report.render(plan.make_plan(params)), flush=True)


def run(params: Params) -> None:
    out_dir = Path(OUTPUT_DIR)
    if params.verifier.source == "pretrained":
        _print_plan(params)
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
    _print_plan(params)  # after the build: before it, data/verifier may hold an older shape
