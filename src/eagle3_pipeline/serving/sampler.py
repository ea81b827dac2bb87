"""Samplers: a batch of prompts (token ids) -> one completion each, seeded per call.

`vllm`: vLLM's in-process engine (`vllm.LLM`), started as extract starts its own: the
verifier's own dtype (vLLM's "auto" would run a float32 checkpoint in bf16), params.vllm
(max_model_len, enforce_eager, engine flags of extra_args such as --dtype), the CPU patches, the
workspace's caches. vLLM on CPU refuses per-request seeds ("CPU Generator does not use offset");
what is reproducible is `torch.manual_seed(seed)` right before `generate` of the same list, so
a call is seeded as a whole and the caller keeps its batches fixed.
`hf`: transformers `generate` with sampling, seeded the same way (left-padded batches).

A completion is the ids the model emitted and whether its turn ended (a stop string or id, or
the model's end of sequence) rather than running into `max_tokens`; the caller decodes.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from eagle3_pipeline.config.params import SynthesizeParams, VllmParams
from eagle3_pipeline.conversations import generation_rows
from eagle3_pipeline.core.progress import log
from eagle3_pipeline.verifier import loading
from eagle3_pipeline.verifier.identity import VerifierFacts

STAGE = "synthesize"


@dataclass(frozen=True)
class Request:
    """How every prompt of one call is continued; temperature 0 is greedy."""

    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()


class Completion(NamedTuple):
    token_ids: list[int]
    ended: bool  # False: still open at max_tokens


class Sampler(Protocol):
    def generate(
        self, prompts: Sequence[Sequence[int]], request: Request, seed: int
    ) -> list[Completion]: ...


class VllmSampler:
    """vLLM's in-process engine, started once."""

    def __init__(self, verifier: VerifierFacts, v: VllmParams, seed: int) -> None:
        from eagle3_pipeline.serving import in_process
        from eagle3_pipeline.serving.server_spec import engine_dtype, model_args

        kwargs = model_args(verifier, v, dtype=engine_dtype(verifier))
        kwargs |= {"seed": seed}
        kwargs |= in_process.engine_overrides(v.extra_args, STAGE)
        log(STAGE, f"starting vLLM in process (dtype {kwargs['dtype']}, {verifier.path})")
        self.llm = in_process.start(kwargs, verifier.path)

    def generate(
        self, prompts: Sequence[Sequence[int]], request: Request, seed: int
    ) -> list[Completion]:
        import torch
        from vllm import SamplingParams

        sampling = SamplingParams(
            n=1,
            temperature=request.temperature,
            top_p=request.top_p if request.temperature > 0 else 1.0,
            max_tokens=request.max_tokens,
            stop=list(request.stop),
            stop_token_ids=list(request.stop_token_ids),
            skip_special_tokens=False,
            include_stop_str_in_output=False,
        )
        torch.manual_seed(seed)
        outputs = self.llm.generate(
            [{"prompt_token_ids": list(p)} for p in prompts], sampling, use_tqdm=False
        )
        return [
            Completion(list(o.outputs[0].token_ids), o.outputs[0].finish_reason == "stop")
            for o in outputs
        ]

    def close(self) -> None:
        del self.llm
        gc.collect()


class HfSampler:
    """transformers `generate`, in this process."""

    def __init__(self, verifier: VerifierFacts, tokenizer: Any) -> None:
        log(STAGE, f"loading the verifier with transformers ({verifier.path})")
        self.tokenizer = tokenizer
        self.model = loading.load_model(verifier)
        self.eos = generation_rows.end_of_turn_ids(tokenizer, self.model)
        pad = tokenizer.pad_token_id
        self.pad = pad if pad is not None else self.eos[0]

    def generate(
        self, prompts: Sequence[Sequence[int]], request: Request, seed: int
    ) -> list[Completion]:
        import torch

        width = max(len(p) for p in prompts)
        ids = torch.tensor([[self.pad] * (width - len(p)) + list(p) for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        stop_ids = list(dict.fromkeys([*request.stop_token_ids, *self.eos]))
        if request.temperature > 0:
            sampling = {
                "do_sample": True,
                "temperature": request.temperature,
                "top_p": request.top_p,
                "top_k": 0,  # as vLLM: no top-k unless asked
            }
        else:
            sampling = {"do_sample": False}
        if request.stop:
            sampling |= {"stop_strings": list(request.stop), "tokenizer": self.tokenizer}
        torch.manual_seed(seed)
        with torch.no_grad():
            out = self.model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=request.max_tokens,
                eos_token_id=stop_ids,
                pad_token_id=self.pad,
                **sampling,
            )
        done = []
        for toks in out[:, width:].tolist():
            end = next((i for i, t in enumerate(toks) if t in stop_ids), None)
            if end is not None:
                done.append(Completion(toks[: end + 1], True))
                continue
            text = self.tokenizer.decode(toks, skip_special_tokens=False)
            done.append(Completion(toks, any(s in text for s in request.stop)))
        return done

    def close(self) -> None:
        del self.model
        gc.collect()


@contextlib.contextmanager
def open_sampler(
    verifier: VerifierFacts, s: SynthesizeParams, v: VllmParams, tokenizer: Any
) -> Iterator[Sampler]:
    """The backend of prepare.synthesize.backend (`s`), closed on exit."""
    if s.backend == "vllm":
        sampler: VllmSampler | HfSampler = VllmSampler(verifier, v, s.seed)
    else:
        sampler = HfSampler(verifier, tokenizer)
    try:
        yield sampler
    finally:
        sampler.close()
