"""What the plan refuses (one line, before any GPU hour) and what it only warns about.

A refusal is a mismatch that would only surface days later, after generate and extract; a
warning is a run that starts, but not as the profile intends. The verifier's custom-code check
lives in verifier.py, shared with the stages that load the model.
"""

from __future__ import annotations

from pathlib import Path

from eagle3_pipeline.config.params import Params
from eagle3_pipeline.conversations import chat_template
from eagle3_pipeline.core.errors import CheckpointError, ParamsError, VerifierError
from eagle3_pipeline.drafter.conventions import RunConventions
from eagle3_pipeline.drafter.shape import DrafterShape
from eagle3_pipeline.plan.inputs import VerifierShape, tokenizer_tokens
from eagle3_pipeline.plan.memory import ServingMemory

THINK_TOKENS = (chat_template.THINK_START, chat_template.THINK_END)


def check_tokenizer(params: Params, config_file: Path | None) -> str:
    """A reasoning parser needs <think> and </think> in the tokenizer or vLLM refuses to start."""
    if config_file is None:
        return "built by the verifier stage (tiny profile)"
    found = tokenizer_tokens(config_file.parent)
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


def check_vocab(params: Params, target_vocab: int, where: str) -> None:
    """The draft vocab is a subset of the verifier's."""
    if params.vocab.draft_vocab_size > target_vocab:
        raise ParamsError(
            f"{where}: vocab.draft_vocab_size={params.vocab.draft_vocab_size} is larger than the "
            f"verifier vocab ({target_vocab}): lower vocab.draft_vocab_size"
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


def _init_warnings(params: Params, d: DrafterShape, run: RunConventions) -> list[str]:
    """An init checkpoint that loads, but whose vocab or (init_mismatch: allow) features and
    wiring this run changes."""
    out: list[str] = []
    if d.draft_vocab_size != params.vocab.draft_vocab_size:
        out.append(
            f"the init checkpoint's draft vocab is {d.draft_vocab_size:,}, vocab.draft_vocab_size "
            f"{params.vocab.draft_vocab_size:,}: its lm_head rows are remapped by target id"
        )
    out += [
        f"train.init_mismatch allow: {diff}: the tensors trained on it are retrained"
        for diff in run.retrained
    ]
    return out


def run_warnings(params: Params, d: DrafterShape, run: RunConventions) -> list[str]:
    """Settings that let the run start but not as the profile intends, in the order met."""
    out = _init_warnings(params, d, run) if run.init is not None else []
    t, max_len = params.train, params.tokenize.max_seq_len
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


def sequence_warnings(params: Params, prompt_tokens: int) -> list[str]:
    """Generated tokens that tokenize would cut: a sample longer than tokenize.max_seq_len."""
    max_new, max_len = params.generate.max_new_tokens, params.tokenize.max_seq_len
    longest, capped = prompt_tokens + max_new, ""
    if params.generate.backend == "vllm" and params.vllm.max_model_len < longest:
        longest, capped = params.vllm.max_model_len, ", capped by vllm.max_model_len"
    if longest <= max_len:
        return []
    return [
        f"a sample reaches {longest:,} tokens (prompt ~{prompt_tokens:,} + "
        f"generate.max_new_tokens {max_new:,}{capped}) but tokenize keeps the first "
        f"{max_len:,}: up to {longest - max_len:,} generated tokens per sample are thrown away: "
        f"raise tokenize.max_seq_len (and vllm.max_model_len) to {longest:,}"
    ]


def memory_warnings(serving: ServingMemory | None) -> list[str]:
    """A verifier that leaves no KV room, or more concurrent requests than the KV cache holds
    (vLLM then preempts and recomputes them)."""
    if serving is None:
        return []
    s = serving
    if s.kv_room_bytes <= 0:
        return [
            f"the verifier's weights ({s.weights_per_gpu / 1e9:,.1f} GB per GPU at TP "
            f"{s.tp}) leave no KV cache in {s.utilization:.0%} of vllm.gpu_memory_gib: raise "
            "vllm.tensor_parallel_size or use GPUs with more memory"
        ]
    if s.max_concurrency < s.concurrency:
        return [
            f"generate.concurrency {s.concurrency} x {s.request_tokens:,} tokens needs "
            f"{s.concurrency * s.request_tokens * s.kv_bytes_per_token / 1e9:,.1f} GB of KV cache "
            f"per GPU but ~{s.kv_room_bytes / 1e9:,.1f} GB holds {s.max_concurrency}: vLLM "
            f"preempts and recomputes requests: set generate.concurrency <= "
            f"{max(1, s.max_concurrency)}"
        ]
    return []
