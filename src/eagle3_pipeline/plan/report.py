"""The text `eagle3 plan` prints (and the verifier stage logs first): rendering only, no checks."""

from __future__ import annotations

from eagle3_pipeline import paths
from eagle3_pipeline.plan import memory, modes
from eagle3_pipeline.plan.plan import Plan

TRAIN_SCRATCH = paths.SCRATCH / "train"  # where the train stage keeps its epoch checkpoints


def _m(n: int) -> str:
    """Millions with one decimal, as the team quotes them; small counts exactly."""
    return f"{n / 1e6:,.1f}M" if n >= 10_000_000 else f"{n:,}"


def _size(n: float) -> str:
    """Bytes in decimal units (disks are sold in them)."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{n:,.0f} B"


def _row(label: str, text: str) -> str:
    return f"{label:<12}{text}"


def _verifier_lines(p: Plan) -> list[str]:
    v = p.verifier
    nested = " under text_config" if v.nested else ""
    code = "auto_map: custom code, allowed" if v.remote_code else "no custom code"
    return [
        _row("verifier", v.source),
        _row(
            "",
            f"{v.model_type}{nested}: {v.num_layers} layers, hidden {v.hidden_size:,}, "
            f"vocab {v.vocab_size:,}; {code}",
        ),
        _row("tokenizer", p.tokenizer),
        _row("layer ids", f"aux {p.aux_layer_ids} + final {p.final_layer_id} (vLLM convention)"),
        _row("", f"distinct, aux in 0..{v.num_layers - 1}, final = num_hidden_layers: ok"),
        *_init_ids_line(p),
        _row(
            "vocab",
            f"draft {p.draft_vocab_size:,} of target {v.vocab_size:,} "
            f"({p.draft_vocab_size / v.vocab_size:.1%}): ok",
        ),
    ]


def _init_ids_line(p: Plan) -> list[str]:
    init = p.conventions.init
    if init is None or init.aux_layer_ids is None:
        return []
    same = "same" if init.vllm_aux_layer_ids == p.aux_layer_ids else "DIFFERENT (retrained)"
    return [_row("", f"init checkpoint's fc trained on {init.describe_ids()}: {same}")]


def _drafter_lines(p: Plan) -> list[str]:
    d = p.drafter
    lines = [
        _row("drafter", d.source),
        _row(
            "",
            f"1 Llama layer: {d.num_attention_heads} heads x {d.head_dim}, "
            f"{d.num_key_value_heads} kv heads, intermediate {d.intermediate_size:,}, "
            f"norm_before_fc {str(d.norm_before_fc).lower()}",
        ),
        _row("wiring", p.conventions.describe()),
        _row(
            "params",
            f"total {_m(p.total_params)} = trainable {_m(p.trainable_params)} "
            f"+ frozen {_m(p.frozen_params)}",
        ),
    ]
    for g in p.groups:
        state = "trainable" if g.trainable else "frozen"
        lines.append(f"  {g.name:<17} {g.shape:<42} {_m(g.count):>9}  {state}")
    return lines


def _cost_lines(p: Plan) -> list[str]:
    bpt = p.store_bytes_per_token
    n = len(p.aux_layer_ids) + 1
    lines = [
        _row("store", f"{n} layers x {p.verifier.hidden_size:,}: {bpt['bf16']:,} B/token bf16,"),
        _row("", f"{bpt['fp8']:,} B/token fp8 (1 B/value + fp32 scale per token and layer)"),
    ]
    lines += [_row("tokens" if i == 0 else "", h) for i, h in enumerate(p.tokens.how)]
    if p.tokens.total is not None:
        lines.append(_row("", f"= {p.tokens.total:,} tokens"))
    lines += _mode_lines(p)
    if p.tokens.total is not None:
        lines += [
            _row(
                "schedule",
                f"{p.train_tokens:,} train tokens / {p.global_batch_tokens:,} per step "
                f"= {p.steps_per_epoch:,} steps/epoch",
            ),
            _row(
                "",
                f"x {p.epochs} epochs = {p.total_steps:,} steps, warm-up {p.warmup_steps:,}",
            ),
        ]
    ckpt = p.checkpoint_weights_bytes + p.checkpoint_optimizer_bytes
    lines += [
        _row(
            "checkpoint",
            f"weights bf16 {_size(p.checkpoint_weights_bytes)} + AdamW fp32 states "
            f"{_size(p.checkpoint_optimizer_bytes)} = {_size(ckpt)} per epoch",
        ),
        _row(
            "",
            f"kept {p.checkpoints_kept} (train.keep_last + the best): "
            f"{_size(ckpt * p.checkpoints_kept)} in {TRAIN_SCRATCH} "
            f"(all {p.epochs} epochs: {_size(ckpt * p.epochs)})",
        ),
    ]
    return lines


def _mode_lines(p: Plan) -> list[str]:
    """Disk and verifier prefill of both hidden-state modes, one table row per sample count."""
    keep = (
        "every val sample (extract.online_keep_val null)"
        if p.online_keep_val is None
        else f"the first {p.online_keep_val:,} val samples by id (extract.online_keep_val)"
    )
    star = {m: "*" if m == p.hidden_states else "" for m in modes.MODES}
    lines = [
        _row(
            "hidden",
            f"disk and verifier prefill in both modes; train.hidden_states: {p.hidden_states} "
            f"(*); disk bf16 (fp8), extract.store_dtype {p.store_dtype}",
        ),
        _row("", "store: extract prefills every sample once and writes it; train reads the store"),
        _row(
            "",
            f"online: vLLM prefills every sample not on disk in each of the {p.epochs} epochs; "
            "on disk:",
        ),
        _row("", f"{keep}, written by extract, read by train and evaluate"),
    ]
    if not p.scales:
        return lines + [_row("", "sample count unknown: pass --prompts N (or --samples N:TOKENS)")]
    head = [
        "samples",
        "x each",
        "= tokens",
        f"{star['store']}store disk",
        "prefill",
        f"{star['online']}online disk",
        "val kept",
        "prefill",
        "",
    ]
    table = [head]
    for c in p.scales:
        store, online = p.disk_bytes(c.store), p.disk_bytes(c.online)
        table.append(
            [
                f"{c.samples:,}",
                f"x {c.tokens_per_sample:,}",
                f"= {_m(c.tokens)}",
                f"{_size(store['bf16'])} ({_size(store['fp8'])})",
                _m(c.store.prefill_tokens),
                f"{_size(online['bf16'])} ({_size(online['fp8'])})",
                f"{c.online.disk_samples:,}",
                _m(c.online.prefill_tokens),
                c.how,
            ]
        )
    widths = [max(len(r[i]) for r in table) for i in range(len(head))]
    left = {3, 5, 8}  # the sizes and where the row comes from; numbers right-aligned
    for r in table:
        cells = [
            f"{cell:<{w}}" if i in left else f"{cell:>{w}}"
            for i, (cell, w) in enumerate(zip(r, widths, strict=True))
        ]
        lines.append(_row("", "  ".join(cells).rstrip()))
    return lines


def _memory_lines(p: Plan) -> list[str]:
    """vLLM's KV room per GPU and the concurrency it holds; training memory per rank."""
    lines: list[str] = []
    s = p.serving
    if s is None:
        lines.append(_row("vLLM memory", "not estimated (set vllm.gpu_memory_gib)"))
    else:
        lines += [
            _row(
                "vLLM memory",
                f"{s.gpu_bytes / 2**30:,.0f} GiB x {s.utilization:.2f} per GPU - weights "
                f"{_size(s.weights_per_gpu)} (/ TP {s.tp}; {s.weights.how}) - runtime "
                f"{_size(memory.RUNTIME_RESERVE_BYTES)} = KV room {_size(max(0, s.kv_room_bytes))}",
            ),
            _row("", f"KV {s.kv_bytes_per_token:,} B/token ({s.kv_how}): {s.kv_tokens:,} tokens"),
            _row(
                "concurrency",
                f"{s.kv_tokens:,} / {s.request_tokens:,} per request ({p.prompt.how} + "
                f"max_new_tokens) = {s.max_concurrency} at once; generate.concurrency "
                f"{s.concurrency}",
            ),
        ]
    t = p.training
    parts = " + ".join(f"{k} {_size(v)}" for k, v in t.parts.items())
    lines.append(
        _row(
            "training",
            f"~{_size(t.total)} per rank ({t.nproc} x {t.strategy}): {parts}",
        )
    )
    return lines


def render(p: Plan) -> str:
    """The whole report: header, verifier, drafter, costs, then one line per warning."""
    head = [_row("plan", f"profile {p.profile} ({p.params_path}), from config files only")]
    warn = [_row("warning", w) for w in p.warnings]
    body = _verifier_lines(p) + _drafter_lines(p) + _cost_lines(p) + _memory_lines(p)
    return "\n".join(head + body + warn)
