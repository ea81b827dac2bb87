"""The text `eagle3 plan` prints (and the verifier stage logs first): rendering only, no checks."""

from __future__ import annotations

from eagle3_pipeline.plan import memory, modes, nodes, totals
from eagle3_pipeline.plan.plan import Plan
from eagle3_pipeline.plan.report_curve import TRAIN_SCRATCH, curve_lines, fraction_lines
from eagle3_pipeline.plan.report_text import millions as _m
from eagle3_pipeline.plan.report_text import row as _row
from eagle3_pipeline.plan.report_text import size as _size
from eagle3_pipeline.plan.report_text import table as _table


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
        *_support_lines(p),
        _row("layer ids", f"aux {p.aux_layer_ids} + final {p.final_layer_id} (vLLM convention)"),
        _row("", f"distinct, aux in 0..{v.num_layers - 1}, final = num_hidden_layers: ok"),
        *_init_ids_line(p),
        _row(
            "vocab",
            f"draft {p.draft_vocab_size:,} of target {v.vocab_size:,} "
            f"({p.draft_vocab_size / v.vocab_size:.1%}): ok",
        ),
    ]


def _support_lines(p: Plan) -> list[str]:
    """The chat template, the installed vLLM against the verifier's class, the params keys."""
    lines = []
    if p.support is not None:
        lines += [
            _row("template", p.support.template.describe()),
            _row("vLLM", p.support.vllm.describe()),
        ]
    if p.params_keys:
        lines.append(_row("keys", f"all {len(p.params_keys)} params keys dvc.yaml reads: present"))
    return lines


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
    n = len(p.store_aux_layer_ids) + 1
    lines = [
        _row("store", f"{n} layers x {p.verifier.hidden_size:,}: {bpt['bf16']:,} B/token bf16,"),
        _row("", f"{bpt['fp8']:,} B/token fp8 (1 B/value + fp32 scale per token and layer)"),
    ]
    if p.store_aux_layer_ids != p.aux_layer_ids:
        lines.insert(
            1,
            _row(
                "",
                f"aux {p.store_aux_layer_ids} + final: the union of train's {p.aux_layer_ids} "
                "and layers.family_aux_layer_ids",
            ),
        )
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


def _cluster_lines(p: Plan) -> list[str]:
    """Each node's work, what it writes and how long it takes (cluster.engine: ray)."""
    c = p.cluster
    if c is None:
        return []
    gpus = f", {c.worker_gpus:g} GPUs" if c.worker_gpus else ""
    lines = [
        _row(
            "cluster",
            f"Ray at {c.address}: each worker asks {c.worker_cpus:g} CPU{gpus}; a lost worker's "
            f"share reruns on another node ({c.max_attempts} attempts at most)",
        ),
        _row("", "every node: the same data/ (one shared filesystem) and the verifier weights"),
        _row(
            "",
            "at verifier.path" + (f" ({_size(c.verifier_bytes)} each)" if c.verifier_bytes else ""),
        ),
    ]
    if not c.inference:
        lines.append(_row("", "generate, extract: sample count unknown (pass --prompts N)"))
    ckpt = (p.checkpoint_weights_bytes + p.checkpoint_optimizer_bytes) * p.checkpoints_kept
    rows = [["node", "stage", "work", "writes to data/", "time"]]
    for i, s in enumerate(c.inference, 1):
        rows.append(
            [
                f"inference {i}",
                "generate",
                f"{s.samples:,} prompts, <= {_m(s.new_tokens)} new tokens "
                f"({c.concurrency} at once)",
                "rows",
                nodes.duration(s.generate_s),
            ]
        )
        rows.append(
            [
                "",
                "extract",
                f"{_m(s.store_tokens)} tokens prefilled",
                f"{_size(s.store_bytes)} {p.store_dtype}",
                nodes.duration(s.extract_s),
            ]
        )
    for i, t in enumerate(c.training, 1):
        rows.append(
            [
                f"training {i}",
                "train",
                f"{t.ranks} rank{'s' if t.ranks > 1 else ''}, {_m(t.tokens_per_epoch)} tokens "
                f"x {c.epochs} epochs",
                f"checkpoints {_size(ckpt)}" if t.writes_checkpoints else "-",
                nodes.duration(t.train_s),
            ]
        )
    if len(rows) > 1:
        lines += _table(rows, left={0, 1, 2, 3})
    times = c.stage_seconds
    if c.inference and c.training:
        parts = " + ".join(f"{k} {nodes.duration(v)}" for k, v in times.items())
        total = nodes.duration(sum(times.values()))
        lines.append(
            _row("", f"stages in turn, each as long as its slowest node: {parts} = ~{total}")
        )
    lines.append(_row("", "times: each share's tokens over reference rates (plan/nodes.py):"))
    lines.append(_row("", c.rates.source))
    return lines


def _gpu_line(t: totals.Totals) -> str:
    if not t.gpus_per_node:
        return _row("gpus", "none: a CPU profile (no vllm.gpu_memory_gib, no GPU workers)")
    node = "node" if t.nodes == 1 else "nodes"
    memory = (
        f"{t.gpu_gib:g} GiB each (vllm.gpu_memory_gib)"
        if t.gpu_gib is not None
        else "memory per GPU not set (vllm.gpu_memory_gib)"
    )
    count = f"{t.gpus_per_node} per node x {t.nodes} {node} = {t.gpus_per_node * t.nodes}"
    return _row("gpus", f"{count}, {memory}")


def _disk_lines(p: Plan, t: totals.Totals) -> list[str]:
    """The verifier's weights on every node; the hidden states and checkpoints on data/."""
    weights = _size(t.weights.bytes) if t.weights is not None else "unknown"
    store = (
        f"hidden states {_size(t.store_bytes)} ({p.store_dtype}, {p.hidden_states} mode)"
        if t.store_bytes is not None
        else "hidden states unknown (pass --prompts N)"
    )
    checkpoints = f"checkpoints {_size(t.checkpoint_bytes)} ({p.checkpoints_kept} kept)"
    if t.curve_bytes:
        checkpoints += f" + curve fractions {_size(t.curve_bytes)}"
    total = _size(t.total_bytes) if t.total_bytes is not None else "unknown"
    if t.nodes == 1:
        return [
            _row(
                "disk",
                f"{total} per node and in all (1 node) = verifier weights {weights} + {store} "
                f"+ {checkpoints}",
            )
        ]
    shared = _size(t.shared_bytes) if t.shared_bytes is not None else "unknown"
    return [
        _row(
            "disk",
            f"per node {weights} (the verifier's weights at verifier.path); data/, shared by the "
            f"{t.nodes} nodes: {shared} = {store} + {checkpoints}",
        ),
        _row("", f"in all: {t.nodes} x {weights} + {shared} = {total}"),
    ]


def _hours_lines(t: totals.Totals) -> list[str]:
    if t.seconds is None:
        return [_row("hours", "unknown: the sample count is unknown (pass --prompts N)")]
    parts = " + ".join(f"{k} {nodes.duration(v)}" for k, v in t.seconds.items())
    hours = sum(t.seconds.values()) / 3600
    return [
        _row(
            "hours",
            f"{parts} = ~{hours:,.1f} h, stages in turn (upper bound: every answer runs to "
            "generate.max_new_tokens)",
        ),
        _row("rates", t.rates.source),
    ]


def _summary_lines(p: Plan) -> list[str]:
    """GPUs, disk per node and in all, hours: what every plan answers."""
    t = p.summary
    if t is None:
        return []
    return [_gpu_line(t), *_disk_lines(p, t), *_hours_lines(t)]


def render(p: Plan) -> str:
    """The whole report: header, where configs came from, verifier, drafter, costs, what the run
    needs in all, then one line per path not here and per warning."""
    head = [_row("plan", f"profile {p.profile} ({p.params_path}), from config files only")]
    head += [_row("shipped", note) for note in p.shipped]
    not_here = [_row("not here", line) for line in p.not_here]
    if not_here:
        not_here.append(_row("", "(planned from config files: the first stage, check, refuses it)"))
    warn = [_row("warning", w) for w in p.warnings]
    body = (
        _verifier_lines(p)
        + _drafter_lines(p)
        + _cost_lines(p)
        + _memory_lines(p)
        + _cluster_lines(p)
        + fraction_lines(p)
        + curve_lines(p)
        + _summary_lines(p)
    )
    return "\n".join(head + body + not_here + warn)
