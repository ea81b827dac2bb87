"""Typed schema of params.yaml, validated once before any stage does work.

Unknown keys are errors (a misspelled key would otherwise be silently ignored and the run would
use a default the user never chose).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import Field, ValidationError, ValidationInfo, model_validator

from eagle3_pipeline.config.families import Families
from eagle3_pipeline.config.layer_ids import family_field, store_aux_layer_ids
from eagle3_pipeline.config.training_params import ClusterParams, Strict, TrainParams
from eagle3_pipeline.core import paths
from eagle3_pipeline.core.errors import ParamsError

DEFAULT_PARAMS = Path("params.yaml")


class TinyVerifierParams(Strict):
    """Shape and brief training of a verifier built from a seed (tiny profiles only)."""

    architecture: Literal["llama", "deepseek_v3"] = "llama"
    num_hidden_layers: int = Field(8, ge=1)
    hidden_size: int = Field(128, ge=8)
    intermediate_size: int = Field(384, ge=8)
    num_attention_heads: int = Field(4, ge=1)
    num_key_value_heads: int = Field(2, ge=1)
    vocab_size: int = Field(2048, ge=300)
    max_position_embeddings: int = Field(2048, ge=64)
    # lm_head shares the embedding matrix, as in many small pretrained chat models.
    tie_word_embeddings: bool = False
    corpus: str = str(paths.CORPUS)
    train_steps: int = Field(300, ge=0)
    train_lr: float = Field(3e-3, gt=0)
    train_seq_len: int = Field(128, ge=8)
    train_batch_size: int = Field(16, ge=1)
    # Greedy answers to the first N chat questions of the corpus, after training: their zlib
    # compression ratio goes to the log and build_stats.json (~1.5 = text, >>3 = repetition
    # loops, which a drafter learns to copy). 0 = off (the stage's output stays as before).
    probe_answers: int = Field(0, ge=0)


class VerifierParams(Strict):
    """Which verifier the drafter is trained for.

    `source: tiny` builds one into `path`; `source: pretrained` uses an existing local directory
    or hub id and only records its identity.
    """

    source: Literal["tiny", "pretrained"] = "tiny"
    path: str = str(paths.VERIFIER)
    name: str | None = None
    revision: str | None = None
    trust_remote_code: bool = False
    tiny: TinyVerifierParams = Field(default_factory=TinyVerifierParams)


class LayersParams(Strict):
    """Layer ids in vLLM's convention: k < N = input of decoder layer k, N = last layer output."""

    aux_layer_ids: list[int] | None = None
    final_layer_id: int | None = None
    # A `families` entry's own aux ids (else aux_layer_ids); extract captures their union.
    family_aux_layer_ids: dict[str, list[int]] = Field(default_factory=dict)


class SynthesizeParams(Strict):
    """Prompts the verifier writes itself, for a team without a prompt set (docs/data.md).

    The Magpie method: the chat template rendered up to a user turn's opening, the verifier
    samples that turn, stopped where the template ends a turn. Batches of `batch_size` are
    seeded by (seed, batch index) and journaled, so a killed run resumes with the same prompts.
    Kept: prompts that are not empty (< min_chars), not truncated (still open at
    max_prompt_tokens), not leaking the template (a role marker or special token inside), not
    an exact or near duplicate (word-shingle Jaccard >= near_duplicate_jaccard) of one kept
    before; each drop is counted by reason in data/synthesized/stats.json.
    """

    count: int = Field(0, ge=0)  # prompts to keep; 0: none (prepare reads prepare.prompts only)
    seed: int = 0
    # Steering: batch i opens its first user turn after system prompt i % len (Magpie's domain
    # system prompts: "the user asks you to write a Python function" draws coding requests);
    # "" = the template's own opening. [] = every batch the template's own opening.
    system_prompts: list[str] = Field(default_factory=list)
    # User turns per conversation; between two, the verifier answers greedily (at most
    # max_answer_tokens): a multi-turn conversation ends with a user turn for generate.
    turns: int = Field(1, ge=1)
    max_prompt_tokens: int = Field(128, ge=4)
    max_answer_tokens: int = Field(256, ge=1)
    temperature: float = Field(1.0, gt=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    batch_size: int = Field(256, ge=1)
    min_chars: int = Field(8, ge=1)
    near_duplicate_jaccard: float = Field(0.8, gt=0.0, le=1.0)
    # Stop (and fail, naming the drop counts) after sampling count x this many conversations
    # (each opens with one sampled user turn; with turns > 1 more follow).
    max_samples_ratio: float = Field(4.0, ge=1.0)
    backend: Literal["hf", "vllm"] = "vllm"  # vllm: its in-process engine; hf: transformers


class PrepareParams(Strict):
    prompts: str = str(paths.PROMPTS)  # given prompt files: a file or a folder
    synthesize: SynthesizeParams = Field(default_factory=SynthesizeParams)
    # Share of the prepared prompts that are synthesized, the rest given (both taken in id-hash
    # order, so a smaller mix is nested in a larger one); null: every prompt of both; 1.0:
    # synthesized prompts only (a team without a prompt set).
    synthesized_share: float | None = Field(None, gt=0.0, le=1.0)
    val_ratio: float = Field(0.1, ge=0.0, lt=1.0)
    max_prompts: int | None = Field(None, ge=1)
    # A row ending with an assistant turn: refuse it, or drop that turn and let the verifier
    # answer in its place (ShareGPT exports end with the answer of the model that wrote them).
    trailing_assistant: Literal["refuse", "regenerate"] = "refuse"
    # The field that holds each row's id. null: `id`, else the dataset's own (prompt_id, uuid,
    # conversation_id, question_id, idx), else an id derived from the conversation's content.
    id_field: str | None = Field(None, min_length=1)
    # A row prepare cannot use (empty, assistant-first, unknown role, duplicate, ...): skip it
    # (counted, and listed in data/prepared/skipped.jsonl), or fail naming the first ones.
    on_unusable: Literal["skip", "fail"] = "skip"


class VllmParams(Strict):
    """How vLLM is started wherever a stage uses it (server or in-process engine)."""

    max_model_len: int = Field(2048, ge=64)
    enforce_eager: bool = True
    tensor_parallel_size: int = Field(1, ge=1)
    ready_timeout_s: float = Field(600.0, gt=0)
    extra_args: list[str] = Field(default_factory=list)
    # Memory of one GPU the profile is sized for (GiB, as torch reports it). Read by `eagle3
    # plan` only (KV-cache room and generate.concurrency); null: not estimated.
    gpu_memory_gib: float | None = Field(None, gt=0)


class GenerateParams(Strict):
    backend: Literal["hf", "vllm"] = "hf"
    # Servers the user already runs (backend vllm): none is started then. One URL, or a fleet
    # that prompts are leased to (each prompt to one server; a server lost mid-run gives its
    # prompts back to the others). A server that wants an API key gets the one in the
    # environment variable EAGLE3_VLLM_API_KEY (never in params).
    server_url: str | None = None
    server_urls: list[str] = Field(default_factory=list)
    # First port tried for each vLLM server the stage starts (server i tries port+i, then
    # port+i+n, ... for n servers, up to 100 ports); null: any free port.
    server_port: int | None = Field(None, ge=1024, le=65535)
    max_new_tokens: int = Field(128, ge=1)
    temperature: float = Field(0.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    batch_size: int = Field(16, ge=1)
    # Requests in flight per server. Greedy decoding is not batch-invariant (CPU kernels, and
    # GPU ones without VLLM_BATCH_INVARIANT=1): rows are the same bytes from run to run, and
    # from 1 to N servers, at 1; above 1 a row can end differently with what it was batched
    # with (docs/cluster.md).
    concurrency: int = Field(8, ge=1)
    reasoning_parser: str | None = "deepseek_r1"
    chat_template_kwargs: dict[str, Any] = Field(default_factory=lambda: {"thinking": True})
    max_retries: int = Field(4, ge=0)
    request_timeout_s: float = Field(300.0, gt=0)
    # last: one answer per conversation, to its last user turn (earlier assistant turns of the
    # data set stay as unsupervised context). every: each user turn answered in turn, with the
    # verifier's own earlier answers as context: N user turns give N supervised rows (turns.py).
    turns: Literal["last", "every"] = "last"

    @model_validator(mode="after")
    def _one_way_to_name_servers(self) -> GenerateParams:
        if self.server_url and self.server_urls:
            raise ValueError(
                "generate.server_url and generate.server_urls are both set: list every server "
                "in generate.server_urls and remove generate.server_url"
            )
        named = [("server_url", self.server_url)] if self.server_url else []
        for key, url in named + [("server_urls", u) for u in self.server_urls]:
            if not url.startswith(("http://", "https://")):
                raise ValueError(
                    f"generate.{key}: {url!r} is not a URL: write http://HOST:PORT (the base "
                    "URL of an OpenAI-compatible server, without /v1)"
                )
        if len(set(self.server_urls)) != len(self.server_urls):
            raise ValueError(
                f"generate.server_urls={self.server_urls} names a server twice: list each once"
            )
        return self

    @property
    def given_servers(self) -> list[str]:
        """Base URLs of the servers the user runs (server_url or server_urls); empty: none."""
        return [u.rstrip("/") for u in ([self.server_url] if self.server_url else self.server_urls)]


class TokenizeParams(Strict):
    max_seq_len: int = Field(512, ge=8)


class ExtractParams(Strict):
    backend: Literal["hf", "vllm"] = "hf"
    max_tokens_per_batch: int = Field(4096, ge=1)
    # fp8: e4m3 with one fp32 scale per token and layer (half the bytes; readers dequantize).
    store_dtype: Literal["bf16", "fp8"] = "bf16"
    # Pre-flight: refuse to start when the disk lacks the estimated store size plus this margin.
    disk_headroom_gb: float = Field(1.0, ge=0.0)
    # train.hidden_states=online: the store keeps only val samples, at most this many (the first
    # by id; null: every val sample). Evaluate simulates on them; train validates on them
    # without asking the server.
    online_keep_val: int | None = Field(None, ge=1)


class VocabParams(Strict):
    draft_vocab_size: int = Field(512, ge=2)


class ExportParams(Strict):
    # speculators: what vLLM auto-detects. flat: the legacy EAGLE-3 layout (AQ-MedAI, SGLang,
    # older vLLM), its aux ids written in the convention of `server`.
    format: Literal["speculators", "flat"] = "speculators"
    server: Literal["vllm", "sglang"] = "vllm"


class EvaluateParams(Strict):
    num_speculative_tokens: int = Field(3, ge=1)
    online: bool = False
    max_eval_prompts: int = Field(24, ge=1)
    max_new_tokens: int = Field(64, ge=1)
    mismatch_ratio: float = Field(0.5, gt=0.0, le=1.0)
    concurrency: int = Field(1, ge=1)
    # Losslessness (evaluation/losslessness.py): both online runs request this many logprobs
    # per token. Greedy outputs with and without the drafter may differ only at a near tie:
    # each token in the other run's top-k and the baseline preferring its own token by at most
    # near_tie_nats (measured here: the two runs' logprobs differ by up to ~0.07 nats).
    top_logprobs: int = Field(5, ge=1, le=20)
    near_tie_nats: float = Field(0.1, ge=0.0)
    # Start the servers without and with the drafter at once, then measure them in turn: one
    # start-up's wait instead of two, where memory holds two verifiers (the CPU profiles); never
    # on a node whose verifier fills its GPUs.
    start_servers_together: bool = False
    # Offline simulation on at most this many val samples (the first by id; null: all). The
    # verifier's greedy tokens are computed once per sample for every drafter simulated.
    max_offline_samples: int | None = Field(None, ge=1)
    # The MISMATCH alarm against the offline figure on the online run's own prompts and first
    # max_new_tokens positions (eval.json offline_same_prompts): fires when vLLM's accepted
    # tokens per draft (mean acceptance length - 1) fall short of it by more than this fraction.
    # mismatch_ratio is the coarse rule used when no online prompt is in the store.
    mismatch_tolerance: float = Field(0.1, gt=0.0, lt=1.0)
    # Further concurrencies at which both servers are timed again on the same prompts (tokens/s
    # with and without the drafter, and acceptance): eval.json online.by_concurrency.
    throughput_concurrency: list[int] = Field(default_factory=list)
    # Further draft counts at which vLLM serves each drafter again (a server start each), and the
    # simulation walks: eval.json online.by_num_speculative_tokens, best_num_speculative_tokens.
    num_speculative_tokens_sweep: list[Annotated[int, Field(ge=1)]] = Field(default_factory=list)
    # The speed-up: both servers up, measured in turn on the same prompts for this many rounds
    # (the order alternating), reported as the median of the rounds' ratios and their spread;
    # a spread (max - min over median) above speedup_max_spread gives no figure, only the
    # spread (a loaded machine). 0: no rounds and no speed-up figure, the servers up one at a
    # time (a node whose memory holds one verifier: the kimi-k2.5 profiles).
    # The vLLM arguments of evaluate's servers (with and without the drafter) instead of
    # vllm.extra_args; null: the same. E.g. generate and extract in bf16 for speed, evaluate in
    # fp32, where the greedy outputs with and without the drafter are the same tokens (bf16's
    # rounding differs between the verifier's one-token and multi-token steps).
    vllm_extra_args: list[str] | None = None
    speedup_rounds: int = Field(5, ge=0)
    speedup_max_spread: float = Field(0.25, gt=0.0)
    # The served headline (evaluation/served.py, prompt_sets.py): besides the val prompts, these
    # public prompt sets that registry packages ship are served with and without the drafter,
    # the first public_set_prompts of each that the training data does not hold, and measured
    # like val (vLLM's per-answer counts, losslessness, paired speed-up at concurrency and each
    # throughput_concurrency). Acceptance by answer position in windows of answer_window tokens.
    public_sets: list[str] = Field(default_factory=list)
    public_set_prompts: int = Field(24, ge=1)
    answer_window: int = Field(64, ge=1)

    @model_validator(mode="after")
    def _positive_concurrency(self) -> EvaluateParams:
        if any(c < 1 for c in self.throughput_concurrency):
            raise ValueError(
                f"evaluate.throughput_concurrency={self.throughput_concurrency}: every value "
                "must be >= 1"
            )
        return self


class CurveParams(Strict):
    """The learning curve (docs/learning-curve.md): the drafter trained, as `train` trains it,
    on nested fractions of the training rows (by the split hash: a fraction holds every
    smaller one), all measured on the same val samples, acceptance fitted against training
    tokens and predicted at `predict_at` times the data."""

    fractions: list[Annotated[float, Field(gt=0.0, lt=1.0)]] = Field(default_factory=list)
    predict_at: list[Annotated[float, Field(gt=1.0)]] = Field(default_factory=lambda: [2.0, 10.0])
    bootstrap_samples: int = Field(1000, ge=10)  # resamples of the val samples, for intervals
    confidence: float = Field(0.9, gt=0.0, lt=1.0)

    @model_validator(mode="after")
    def _distinct(self) -> CurveParams:
        if len(set(self.fractions)) != len(self.fractions):
            raise ValueError(f"curve.fractions={self.fractions} names a fraction twice")
        return self


class Params(Strict):
    profile: str = "tiny-llama"
    seed: int = 0
    verifier: VerifierParams = Field(default_factory=VerifierParams)
    vllm: VllmParams = Field(default_factory=VllmParams)
    layers: LayersParams = Field(default_factory=LayersParams)
    prepare: PrepareParams = Field(default_factory=PrepareParams)
    generate: GenerateParams = Field(default_factory=GenerateParams)
    tokenize: TokenizeParams = Field(default_factory=TokenizeParams)
    extract: ExtractParams = Field(default_factory=ExtractParams)
    vocab: VocabParams = Field(default_factory=VocabParams)
    train: TrainParams = Field(default_factory=TrainParams)
    export: ExportParams = Field(default_factory=ExportParams)
    evaluate: EvaluateParams = Field(default_factory=EvaluateParams)
    cluster: ClusterParams = Field(default_factory=ClusterParams)
    families: Families = Field(default_factory=dict)  # docs/families.md
    curve: CurveParams = Field(default_factory=CurveParams)

    @model_validator(mode="after")
    def _family_layers(self) -> Params:
        """Own aux ids belong to a `families` entry: an id list no branch reads is a typo."""
        for name in self.layers.family_aux_layer_ids:
            if name not in self.families:
                raise ValueError(
                    f"{family_field(name)}: no `families` entry {name!r} (entries: "
                    f"{', '.join(self.families) or 'none'}): add the entry or remove the ids"
                )
        return self

    @model_validator(mode="after")
    def _curve_reads_the_store(self) -> Params:
        """Refused at load (the check stage, first): not at curve_train, after the long stages."""
        if self.curve.fractions and self.train.hidden_states == "online":
            raise ValueError(
                "curve.fractions trains on the hidden-state store, which train.hidden_states: "
                "online does not write: set curve.fractions: [] or train.hidden_states: store"
            )
        return self

    @model_validator(mode="after")
    def _tiny_layer_ids(self, info: ValidationInfo) -> Params:
        """Check layer ids and vocab sizes against the tiny verifier's shape, known from params."""
        if self.verifier.source == "tiny":
            tiny = self.verifier.tiny
            where = (info.context or {}).get("path", "params.yaml")
            store_aux_layer_ids(self.layers, tiny.num_hidden_layers, where=where)
            if self.vocab.draft_vocab_size > tiny.vocab_size:
                raise ValueError(
                    f"vocab.draft_vocab_size={self.vocab.draft_vocab_size} is larger than the "
                    f"verifier vocab ({tiny.vocab_size}): lower vocab.draft_vocab_size"
                )
        return self


def _format_validation_error(path: Path, err: ValidationError) -> str:
    first = err.errors()[0]
    field = ".".join(str(p) for p in first["loc"]) or "(top level)"
    kind = first["type"]
    if kind == "extra_forbidden":
        return f"{path}: unknown key '{field}': remove it or fix its spelling (see README, params)"
    msg = first["msg"].removeprefix("Value error, ")
    if "input" in first and kind != "value_error":
        return f"{path}: field '{field}': {msg} (got {first['input']!r})"
    return f"{path}: {msg}" if field == "(top level)" else f"{path}: field '{field}': {msg}"


def load_params(path: str | Path = DEFAULT_PARAMS) -> Params:
    """Read and validate params.yaml; every problem becomes one ParamsError line."""
    path = Path(path)
    if not path.is_file():
        raise ParamsError(f"{path}: file not found: run from the repo root or pass --params PATH")
    try:
        raw = yaml.safe_load(path.read_bytes())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise ParamsError(f"{path}:{where} is not valid YAML: fix the syntax") from None
    if raw is None:
        # Defaults the user never chose must not run silently: an empty file is a mistake.
        raise ParamsError(
            f"{path}: file is empty: copy a profile (make profile PROFILE=tiny-llama) or write "
            "the sections (verifier, train, ...)"
        )
    if not isinstance(raw, dict):
        raise ParamsError(
            f"{path}: top level is a {type(raw).__name__}, not a mapping of sections "
            "(verifier, train, ...): fix the file (see profiles/)"
        )
    try:
        return Params.model_validate(raw, context={"path": str(path)})
    except ValidationError as err:
        raise ParamsError(_format_validation_error(path, err)) from None
