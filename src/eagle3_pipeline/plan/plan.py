"""`eagle3 plan`: what a run will build and cost, from config files alone, before any GPU hour.

Reads the verifier's config.json (through multimodal `text_config` nesting), its tokenizer files
when present, the init drafter's config.json and params; never weights. A mismatch that would
only surface days later (after generate and extract) stops here as one line. The parameter
counts follow speculators 0.9.0's `Eagle3DraftModel` (tests/test_plan.py checks them against an
instantiated model).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3_pipeline import verifier as vf
from eagle3_pipeline.errors import CheckpointError, ParamsError, VerifierError
from eagle3_pipeline.layer_ids import resolve_layer_ids
from eagle3_pipeline.params import Params

# speculators 0.9.0 trains eagle3 drafters with norm_before_fc on unless the config says otherwise.
TRAINER_NORM_BEFORE_FC = True
# Average characters per token, used only to guess prompt length from prompt files.
CHARS_PER_TOKEN = 4
ASSUMED_PROMPT_TOKENS = 256
THINK_TOKENS = ("<think>", "</think>")


@dataclass(frozen=True)
class VerifierShape:
    """The verifier's text model as far as the drafter is concerned."""

    source: str
    model_type: str
    nested: bool
    num_layers: int
    hidden_size: int
    vocab_size: int
    remote_code: bool


@dataclass(frozen=True)
class DrafterShape:
    """One EAGLE-3 decoder layer (Llama) plus heads, from an init checkpoint or the verifier."""

    source: str
    hidden_size: int
    target_vocab_size: int
    draft_vocab_size: int
    aux_layer_ids: list[int] | None
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    attention_bias: bool
    mlp_bias: bool
    norm_before_fc: bool
    fc_norm: bool = False
    config_file: Path | None = None
    # A flat file not written by us: its aux ids follow the convention of whoever trained it.
    legacy_flat: bool = False


@dataclass(frozen=True)
class ParamGroup:
    name: str
    shape: str
    count: int
    trainable: bool


@dataclass(frozen=True)
class TokenEstimate:
    total: int | None
    how: list[str]


@dataclass
class Plan:
    profile: str
    params_path: str
    verifier: VerifierShape
    tokenizer: str
    aux_layer_ids: list[int]
    final_layer_id: int
    draft_vocab_size: int
    drafter: DrafterShape
    groups: list[ParamGroup]
    store_bytes_per_token: dict[str, int]
    tokens: TokenEstimate
    train_tokens: int | None
    steps_per_epoch: int | None
    total_steps: int | None
    warmup_steps: int | None
    checkpoint_weights_bytes: int
    checkpoint_optimizer_bytes: int
    epochs: int
    keep_last: int | None
    max_tokens_per_batch: int
    warnings: list[str] = field(default_factory=list)

    @property
    def checkpoints_kept(self) -> int:
        """Epoch checkpoints on disk at most: the last keep_last plus the best one."""
        if self.keep_last is None:
            return self.epochs
        return min(self.epochs, self.keep_last + 1)

    @property
    def total_params(self) -> int:
        return sum(g.count for g in self.groups)

    @property
    def trainable_params(self) -> int:
        return sum(g.count for g in self.groups if g.trainable)

    @property
    def frozen_params(self) -> int:
        return self.total_params - self.trainable_params

    @property
    def store_bytes(self) -> dict[str, int] | None:
        if self.tokens.total is None:
            return None
        return {k: v * self.tokens.total for k, v in self.store_bytes_per_token.items()}


# ---- reading config files -------------------------------------------------------------------


def _config_file(path: str | Path) -> Path:
    """A config.json itself, or the model directory holding it (existing or not)."""
    path = Path(path)
    return path if path.suffix == ".json" and not path.is_dir() else path / "config.json"


def _read_json(path: Path, error: type[Exception], fix: str) -> dict[str, Any]:
    if not path.is_file():
        raise error(f"{path}: not found: {fix}")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise error(f"{path}: not valid JSON (line {exc.lineno}): {fix}") from None
    if not isinstance(data, dict):
        raise error(f"{path}: top level is not a JSON object: {fix}")
    return data


def tiny_verifier_config(params: Params) -> dict[str, Any]:
    """The config the verifier stage will write for a tiny profile, so plan works before it runs."""
    t = params.verifier.tiny
    return {
        "model_type": t.architecture,
        "num_hidden_layers": t.num_hidden_layers,
        "hidden_size": t.hidden_size,
        "intermediate_size": t.intermediate_size,
        "num_attention_heads": t.num_attention_heads,
        "num_key_value_heads": t.num_key_value_heads,
        "vocab_size": t.vocab_size,
    }


def load_verifier_config(params: Params, override: str | Path | None) -> tuple[dict, Path | None]:
    """(config, its file); a tiny verifier not built yet is described from params."""
    if override is not None:
        path = _config_file(override)
    else:
        path = Path(params.verifier.path) / "config.json"
        if params.verifier.source == "tiny" and not path.is_file():
            return tiny_verifier_config(params), None
    fix = "set verifier.path to the model directory or pass --verifier-config PATH"
    config = _read_json(path, VerifierError, fix)
    if override is None and params.verifier.source == "tiny":
        tiny, built = params.verifier.tiny, vf.text_config(config)
        if (built.get("num_hidden_layers"), built.get("hidden_size")) != (
            tiny.num_hidden_layers,
            tiny.hidden_size,
        ):  # built from older params: the verifier stage will rebuild it from these
            return tiny_verifier_config(params), None
    return config, path


def verifier_shape(config: dict[str, Any], source: str) -> VerifierShape:
    tc = vf.text_config(config)
    for key in ("num_hidden_layers", "hidden_size", "vocab_size"):
        if not isinstance(tc.get(key), int):
            raise VerifierError(f"{source}: text config has no integer {key}: is it a causal LM?")
    return VerifierShape(
        source=source,
        model_type=str(tc.get("model_type", "?")),
        nested=tc is not config,
        num_layers=tc["num_hidden_layers"],
        hidden_size=tc["hidden_size"],
        vocab_size=tc["vocab_size"],
        remote_code=vf.needs_remote_code(config) or vf.needs_remote_code(tc),
    )


def check_remote_code(params: Params, shape: VerifierShape) -> None:
    """vLLM and transformers refuse auto_map models without trust_remote_code, at hour one."""
    if shape.remote_code and not params.verifier.trust_remote_code:
        raise VerifierError(
            f"{shape.source} has auto_map (custom code) but verifier.trust_remote_code is false: "
            "set verifier.trust_remote_code: true if you trust this model's code"
        )


def _tokenizer_tokens(directory: Path) -> tuple[str, set[str]] | None:
    """(files read, token strings) from tokenizer.json / tokenizer_config.json, if present."""
    tokens: set[str] = set()
    read: list[str] = []
    tok_json = directory / "tokenizer.json"
    if tok_json.is_file():
        data = _read_json(tok_json, VerifierError, "the verifier's tokenizer files are damaged")
        tokens |= {t.get("content", "") for t in data.get("added_tokens") or []}
        vocab = (data.get("model") or {}).get("vocab")
        if isinstance(vocab, dict):
            tokens |= set(vocab)
        read.append(tok_json.name)
    tok_cfg = directory / "tokenizer_config.json"
    if tok_cfg.is_file():
        data = _read_json(tok_cfg, VerifierError, "the verifier's tokenizer files are damaged")
        decoder = data.get("added_tokens_decoder") or {}
        tokens |= {t.get("content", "") for t in decoder.values() if isinstance(t, dict)}
        read.append(tok_cfg.name)
    return (", ".join(read), tokens) if read else None


def check_tokenizer(params: Params, config_file: Path | None) -> str:
    """A reasoning parser needs <think> and </think> in the tokenizer or vLLM refuses to start."""
    if config_file is None:
        return "built by the verifier stage (tiny profile)"
    found = _tokenizer_tokens(config_file.parent)
    if found is None:
        return f"no tokenizer files beside {config_file} (not checked)"
    files, tokens = found
    missing = [t for t in THINK_TOKENS if t not in tokens]
    parser = params.generate.reasoning_parser
    if parser and missing:
        raise VerifierError(
            f"{config_file.parent}/{files.split(', ')[0]}: no {' '.join(missing)} token but "
            f"generate.reasoning_parser is {parser!r} (vLLM refuses to start): use the model's "
            "own tokenizer or set generate.reasoning_parser: null"
        )
    return f"{files}: " + ("<think>/</think> present" if not missing else "no <think> tokens")


# ---- layer ids and vocab ------------------------------------------------------------------


def check_vocab(params: Params, target_vocab: int, where: str) -> None:
    if params.vocab.draft_vocab_size > target_vocab:
        raise ParamsError(
            f"{where}: vocab.draft_vocab_size={params.vocab.draft_vocab_size} is larger than the "
            f"verifier vocab ({target_vocab}): lower vocab.draft_vocab_size"
        )


# ---- the drafter's shape ------------------------------------------------------------------


def load_init_config(params: Params, override: str | Path | None) -> tuple[dict, Path] | None:
    if override is None and params.train.init_from is None:
        return None
    path = _config_file(override if override is not None else params.train.init_from)
    fix = "download the init drafter's config.json there or pass --init-config PATH"
    return _read_json(path, CheckpointError, fix), path


def _int(cfg: dict[str, Any], key: str, where: Path) -> int:
    value = cfg.get(key)
    if not isinstance(value, int):
        raise CheckpointError(f"{where}: no integer {key}: is this an EAGLE-3 drafter config?")
    return value


def drafter_from_init(config: dict[str, Any], where: Path) -> DrafterShape:
    """Both formats: speculators (`transformer_layer_config`) and legacy flat (EAGLE/SpecForge)."""
    speculators_format = isinstance(config.get("transformer_layer_config"), dict)
    layer = config["transformer_layer_config"] if speculators_format else config
    eagle = config.get("eagle_config") or {}
    hidden = _int(layer, "hidden_size", where)
    heads = _int(layer, "num_attention_heads", where)
    target_vocab = _int(layer, "vocab_size", where)
    aux_key = "eagle_aux_hidden_state_layer_ids"
    aux = config.get(aux_key, eagle.get(aux_key))
    norm_before_fc = config.get("norm_before_fc", eagle.get("norm_before_fc", False))
    arch = "speculators" if speculators_format else "legacy flat"
    return DrafterShape(
        source=f"init checkpoint {where} ({arch}, {', '.join(config.get('architectures', []))})",
        hidden_size=hidden,
        target_vocab_size=target_vocab,
        draft_vocab_size=int(config.get("draft_vocab_size") or target_vocab),
        aux_layer_ids=list(aux) if aux is not None else None,
        intermediate_size=_int(layer, "intermediate_size", where),
        num_attention_heads=heads,
        num_key_value_heads=int(layer.get("num_key_value_heads") or heads),
        head_dim=int(layer.get("head_dim") or hidden // heads),
        attention_bias=bool(layer.get("attention_bias", False)),
        mlp_bias=bool(layer.get("mlp_bias", False)),
        norm_before_fc=bool(norm_before_fc),
        fc_norm=bool(config.get("fc_norm", False)),
        config_file=where,
        legacy_flat=not speculators_format and "eagle3_pipeline" not in config,
    )


def drafter_from_verifier(config: dict[str, Any], params: Params, aux: list[int]) -> DrafterShape:
    """What speculators builds without an init checkpoint: a Llama layer shaped like the verifier.

    Mirrors speculators.train.cli.create_transformer_layer_config on the raw config.json (an MoE
    verifier without a dense intermediate_size gets 3 x hidden).
    """
    tc = vf.text_config(config)
    hidden, heads = int(tc["hidden_size"]), int(tc["num_attention_heads"])
    kv_heads = int(tc.get("num_key_value_heads") or heads)
    head_dim = tc.get("head_dim")
    if head_dim and hidden % heads and not hidden % head_dim:
        heads = hidden // head_dim
        kv_heads = kv_heads if heads % kv_heads == 0 else heads
    return DrafterShape(
        source="verifier config + speculators defaults (no train.init_from)",
        hidden_size=hidden,
        target_vocab_size=int(tc["vocab_size"]),
        draft_vocab_size=params.vocab.draft_vocab_size,
        aux_layer_ids=aux,
        intermediate_size=int(tc.get("intermediate_size") or 3 * hidden),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=int(head_dim or hidden // heads),
        attention_bias=False,
        mlp_bias=False,
        norm_before_fc=TRAINER_NORM_BEFORE_FC,
    )


def check_init(
    drafter: DrafterShape, verifier: VerifierShape, params: Params, aux: list[int]
) -> None:
    """An init checkpoint whose shapes differ cannot be loaded, or loads into the wrong layers."""
    where = drafter.config_file
    if drafter.hidden_size != verifier.hidden_size:
        raise CheckpointError(
            f"{where}: hidden_size {drafter.hidden_size} but the verifier's is "
            f"{verifier.hidden_size}: train.init_from must be a drafter for this verifier"
        )
    if drafter.target_vocab_size != verifier.vocab_size:
        raise CheckpointError(
            f"{where}: vocab_size {drafter.target_vocab_size} but the verifier's is "
            f"{verifier.vocab_size}: train.init_from must be a drafter for this verifier"
        )
    if (
        drafter.draft_vocab_size != params.vocab.draft_vocab_size
        and params.train.init_vocab_mismatch == "refuse"
    ):
        raise CheckpointError(
            f"{where}: draft_vocab_size {drafter.draft_vocab_size} but vocab.draft_vocab_size is "
            f"{params.vocab.draft_vocab_size} and train.init_vocab_mismatch is refuse: set "
            f"vocab.draft_vocab_size: {drafter.draft_vocab_size}, or init_vocab_mismatch: remap"
        )
    init_aux = drafter.aux_layer_ids
    if init_aux is not None and len(init_aux) != len(aux):
        raise CheckpointError(
            f"{where}: fc takes {len(init_aux)} aux layers {init_aux} but layers.aux_layer_ids "
            f"has {len(aux)} {aux}: set layers.aux_layer_ids to {len(init_aux)} ids"
        )


# ---- counting ---------------------------------------------------------------------------


def _linear(n_in: int, n_out: int, bias: bool) -> int:
    return n_in * n_out + (n_out if bias else 0)


def parameter_groups(d: DrafterShape, n_aux: int, train_lm_head: bool) -> list[ParamGroup]:
    """Eagle3DraftModel's parameters by module, from shapes alone (no torch).

    The one decoder layer's q/k/v read 2H (token embedding + hidden state); `verifier_lm_head`
    is speculators' frozen copy of the verifier's lm_head rows for the draft vocab (the targets).
    """
    h, n_in = d.hidden_size, n_aux * d.hidden_size
    q_out = d.num_attention_heads * d.head_dim
    kv_out = d.num_key_value_heads * d.head_dim
    inter, bias = d.intermediate_size, d.attention_bias
    attention = (
        _linear(2 * h, q_out, bias) + 2 * _linear(2 * h, kv_out, bias) + _linear(q_out, h, bias)
    )
    mlp = 2 * _linear(h, inter, d.mlp_bias) + _linear(inter, h, d.mlp_bias)
    # input_layernorm, hidden_norm, post_attention_layernorm, final norm; before fc either one
    # input_norm over n*H (norm_before_fc) or one norm per aux layer (fc_norm): n*H either way.
    fc_input_norm = d.norm_before_fc or d.fc_norm
    norms = 4 * h + (n_in if fc_input_norm else 0)
    norm_names = f"4 x {h:,}" + (f" + input_norm {n_in:,}" if fc_input_norm else "")
    heads = f"{d.draft_vocab_size:,} x {h:,}"
    vocab = d.target_vocab_size
    attention_shape = f"qkv {2 * h:,} -> {q_out:,}+2x{kv_out:,}, o -> {h:,}"
    return [
        ParamGroup("embed_tokens", f"{vocab:,} x {h:,}", vocab * h, False),
        ParamGroup("fc", f"{n_in:,} -> {h:,}", n_in * h, True),
        ParamGroup("attention", attention_shape, attention, True),
        ParamGroup("mlp", f"{h:,} -> {inter:,} -> {h:,}", mlp, True),
        ParamGroup("norms", norm_names, norms, True),
        ParamGroup("lm_head", heads, d.draft_vocab_size * h, train_lm_head),
        ParamGroup("verifier_lm_head", heads, d.draft_vocab_size * h, False),
        ParamGroup("verifier_norm", f"{h:,}", h, False),
    ]


def store_bytes_per_token(n_layers: int, hidden: int) -> dict[str, int]:
    """Hidden states only: bf16 2 B/value; fp8 1 B/value + one fp32 scale per token and layer."""
    return {"bf16": n_layers * hidden * 2, "fp8": n_layers * hidden + n_layers * 4}


def checkpoint_bytes(groups: list[ParamGroup], d: DrafterShape) -> tuple[int, int]:
    """(weights, optimizer) of one epoch checkpoint as speculators saves it.

    Weights in bf16 without verifier_lm_head/verifier_norm (never saved), plus d2t (int64) and
    t2d (bool) when the draft vocab is smaller; AdamW keeps two fp32 moments per trainable value.
    """
    saved = sum(g.count for g in groups if not g.name.startswith("verifier_"))
    mapping = 0
    if d.draft_vocab_size != d.target_vocab_size:
        mapping = d.draft_vocab_size * 8 + d.target_vocab_size
    trainable = sum(g.count for g in groups if g.trainable)
    return saved * 2 + mapping, trainable * 8


# ---- tokens and schedule --------------------------------------------------------------------


def _prompt_stats(source: Path) -> tuple[int, int] | None:
    """(prompts, characters of their messages) in a .jsonl file or directory, if readable."""
    files = [source] if source.is_file() else sorted(source.glob("*.jsonl"))
    if not files:
        return None
    count = chars = 0
    for f in files:
        for line in f.read_text().splitlines():
            if not line.strip():
                continue
            count += 1
            try:
                chars += sum(len(m.get("content", "")) for m in json.loads(line)["messages"])
            except (ValueError, KeyError, TypeError, AttributeError):
                chars += len(line)
    return count, chars


def estimate_tokens(params: Params, tokens: int | None, prompts: int | None) -> TokenEstimate:
    """Tokens the store will hold: given, or prompts x min(prompt + max_new_tokens, max_seq_len).

    An upper bound: it assumes every answer runs to generate.max_new_tokens.
    """
    if tokens is not None:
        return TokenEstimate(tokens, ["given (--tokens)"])
    source = Path(params.prepare.prompts)
    stats = _prompt_stats(source) if source.exists() else None
    cap = params.prepare.max_prompts
    if prompts is not None:
        n, how_n = prompts, "--prompts"
    elif stats is not None:
        n, how_n = min(stats[0], cap or stats[0]), f"in {source}"
    elif cap is not None:
        n, how_n = cap, f"prepare.max_prompts; {source} not found"
    else:
        return TokenEstimate(None, [f"unknown: {source} not found; pass --tokens N or --prompts N"])
    if stats is not None and stats[0]:
        prompt_len = max(1, round(stats[1] / stats[0] / CHARS_PER_TOKEN))
        how_len = f"~{prompt_len:,} prompt (chars/{CHARS_PER_TOKEN})"
    else:
        prompt_len = ASSUMED_PROMPT_TOKENS
        how_len = f"{prompt_len:,} prompt (assumed)"
    max_new, max_len = params.generate.max_new_tokens, params.tokenize.max_seq_len
    per_sample = min(prompt_len + max_new, max_len)
    how = [
        f"{n:,} prompts ({how_n})",
        f"x min({how_len} + {max_new:,} new, max_seq_len {max_len:,}) = {per_sample:,} per sample",
        "(upper bound: every answer runs to generate.max_new_tokens)",
    ]
    return TokenEstimate(n * per_sample, how)


def schedule(params: Params, total_tokens: int) -> tuple[int, int, int, int]:
    """(train tokens, steps per epoch, total steps, warm-up steps) as speculators resolves them.

    One optimizer step per packed batch of train.max_tokens_per_batch tokens; warm-up is
    int(total steps x warmup_ratio).
    """
    t = params.train
    train_tokens = round(total_tokens * (1 - params.prepare.val_ratio))
    steps = math.ceil(train_tokens / t.max_tokens_per_batch)
    total = steps * t.epochs
    return train_tokens, steps, total, int(total * t.warmup_ratio)


# ---- warnings (the run starts, but not as the profile intends) -------------------------------


def run_warnings(
    params: Params, d: DrafterShape, has_init: bool, aux: list[int] | None = None
) -> list[str]:
    out: list[str] = []
    t, max_len = params.train, params.tokenize.max_seq_len
    if has_init and d.norm_before_fc != TRAINER_NORM_BEFORE_FC:
        out.append(
            f"the init checkpoint has norm_before_fc={str(d.norm_before_fc).lower()}; export and "
            f"evaluate expect {str(TRAINER_NORM_BEFORE_FC).lower()} (drafter.SERVING_FLAGS)"
        )
    if has_init and d.draft_vocab_size != params.vocab.draft_vocab_size:
        out.append(
            f"the init checkpoint's draft vocab is {d.draft_vocab_size:,}, vocab.draft_vocab_size "
            f"{params.vocab.draft_vocab_size:,}: its lm_head rows are remapped by target id"
        )
    if has_init and d.aux_layer_ids is not None and aux is not None:
        if d.legacy_flat:
            out.append(
                f"the init checkpoint (legacy flat) lists aux ids {d.aux_layer_ids}; SpecForge and "
                "SGLang read a flat file's id k as the OUTPUT of layer k, i.e. vLLM's k+1 "
                f"({[k + 1 for k in d.aux_layer_ids]}); layers.aux_layer_ids is {aux}: fc is "
                "fine-tuned on the features params name"
            )
        elif d.aux_layer_ids != aux:
            out.append(
                f"the init checkpoint's fc was trained on aux layers {d.aux_layer_ids}, "
                f"layers.aux_layer_ids is {aux}: fc is fine-tuned on other features"
            )
    if params.extract.max_tokens_per_batch < max_len:
        out.append(
            f"extract.max_tokens_per_batch={params.extract.max_tokens_per_batch} < "
            f"tokenize.max_seq_len={max_len}: extract refuses a full-length sample"
        )
    if t.max_tokens_per_batch < max_len:
        out.append(
            f"train.max_tokens_per_batch={t.max_tokens_per_batch} < tokenize.max_seq_len="
            f"{max_len}: a full-length sample does not fit one packed batch"
        )
    max_new = params.generate.max_new_tokens
    if params.generate.backend == "vllm" and params.vllm.max_model_len < max_new:
        out.append(
            f"vllm.max_model_len={params.vllm.max_model_len} < generate.max_new_tokens="
            f"{max_new}: answers are cut by the server"
        )
    return out


# ---- the plan ---------------------------------------------------------------------------


def make_plan(
    params: Params,
    params_path: str | Path = "params.yaml",
    verifier_config: str | Path | None = None,
    init_config: str | Path | None = None,
    tokens: int | None = None,
    prompts: int | None = None,
) -> Plan:
    """Every check in the order a run would meet it; raises the first mismatch as one line."""
    where = str(params_path)
    config, config_file = load_verifier_config(params, verifier_config)
    v = verifier_shape(config, str(config_file or f"{where} (verifier.tiny)"))
    check_remote_code(params, v)
    tokenizer = check_tokenizer(params, config_file)
    aux, final = resolve_layer_ids(params.layers, v.num_layers, where=where)
    check_vocab(params, v.vocab_size, where)
    init = load_init_config(params, init_config)
    if init is not None:
        drafter = drafter_from_init(*init)
        check_init(drafter, v, params, aux)
    else:
        drafter = drafter_from_verifier(config, params, aux)
    groups = parameter_groups(drafter, len(aux), params.train.train_lm_head)
    weights, optimizer = checkpoint_bytes(groups, drafter)
    estimate = estimate_tokens(params, tokens, prompts)
    steps = schedule(params, estimate.total) if estimate.total is not None else (None,) * 4
    return Plan(
        profile=params.profile,
        params_path=where,
        verifier=v,
        tokenizer=tokenizer,
        aux_layer_ids=aux,
        final_layer_id=final,
        draft_vocab_size=params.vocab.draft_vocab_size,
        drafter=drafter,
        groups=groups,
        store_bytes_per_token=store_bytes_per_token(len(aux) + 1, v.hidden_size),
        tokens=estimate,
        train_tokens=steps[0],
        steps_per_epoch=steps[1],
        total_steps=steps[2],
        warmup_steps=steps[3],
        checkpoint_weights_bytes=weights,
        checkpoint_optimizer_bytes=optimizer,
        epochs=params.train.epochs,
        keep_last=params.train.keep_last,
        max_tokens_per_batch=params.train.max_tokens_per_batch,
        warnings=run_warnings(params, drafter, init is not None, aux),
    )


# ---- printing ---------------------------------------------------------------------------


def _m(n: int) -> str:
    """Millions with one decimal, as the team quotes them; small counts exactly."""
    return f"{n / 1e6:,.1f}M" if n >= 10_000_000 else f"{n:,}"


def _size(n: float) -> str:
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
        _row(
            "vocab",
            f"draft {p.draft_vocab_size:,} of target {v.vocab_size:,} "
            f"({p.draft_vocab_size / v.vocab_size:.1%}): ok",
        ),
    ]


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
    if p.tokens.total is not None and p.store_bytes is not None:
        sizes = p.store_bytes
        lines += [
            _row(
                "",
                f"= {p.tokens.total:,} tokens: store {_size(sizes['bf16'])} bf16, "
                f"{_size(sizes['fp8'])} fp8",
            ),
            _row(
                "schedule",
                f"{p.train_tokens:,} train tokens / {p.max_tokens_per_batch:,} per batch "
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
            f"{_size(ckpt * p.checkpoints_kept)} in data/.work/train "
            f"(all {p.epochs} epochs: {_size(ckpt * p.epochs)})",
        ),
    ]
    return lines


def render(p: Plan) -> str:
    head = [_row("plan", f"profile {p.profile} ({p.params_path}), from config files only")]
    warn = [_row("warning", w) for w in p.warnings]
    return "\n".join(head + _verifier_lines(p) + _drafter_lines(p) + _cost_lines(p) + warn)
