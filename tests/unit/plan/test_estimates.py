"""estimates: tokens from prompt files, the schedule speculators will run, store bytes."""

from __future__ import annotations

import json
from pathlib import Path

from plan_cases import PROFILE

from eagle3_pipeline.config.params import Params, load_params
from eagle3_pipeline.plan import estimates
from eagle3_pipeline.store.format import StoreLayout


def test_schedule_from_prompt_files(tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    rows = [{"id": f"p{i}", "messages": [{"role": "user", "content": "x" * 400}]} for i in range(3)]
    prompts.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    params = load_params(PROFILE).model_copy(deep=True)
    params.prepare.prompts = str(prompts)
    params.tokenize.max_seq_len = 8192
    estimate = estimates.estimate_tokens(params, tokens=None, prompts=None)
    assert estimate.total == 3 * 8192  # 100 prompt + 16,384 new, capped at max_seq_len 8,192
    params.tokenize.max_seq_len = 32768
    assert estimates.estimate_tokens(params, None, None).total == 3 * (100 + 16384)
    params.train.nproc, params.train.max_tokens_per_batch = 1, 8192
    params.train.warmup_ratio = 0.01
    assert estimates.schedule(params, 100_000) == (90_000, 11, 55, 0)
    # One optimizer step takes every rank's batch, grad_accumulation times.
    params.train.nproc, params.train.grad_accumulation = 8, 2
    assert estimates.global_batch_tokens(params) == 8 * 2 * 8192
    assert estimates.schedule(params, 10_000_000)[1] == -(-9_000_000 // (16 * 8192))


def test_store_bytes_per_token_are_the_store_formats() -> None:
    """The plan's estimate and extract's disk check read the same formula."""
    from eagle3_pipeline.store import format as store_format
    from eagle3_pipeline.store import sizes

    assert set(sizes.STORE_DTYPES) == set(store_format.TORCH_DTYPES)
    per_token = estimates.store_bytes_per_token(4, 7168)
    for dtype in ("bf16", "fp8"):
        layout = StoreLayout([2, 30, 58], 61, 7168, dtype, verifier={})
        assert per_token[dtype] == layout.bytes_per_token()


def test_prompt_tokens_come_from_the_verifiers_template(tiny_verifier_dir: Path, tmp_path) -> None:
    """A default system prompt is part of every prompt the server sees: the plan counts it."""
    import shutil

    from templates import CHATML_DEFAULT_SYSTEM
    from transformers import AutoTokenizer

    verifier = tmp_path / "verifier"
    shutil.copytree(tiny_verifier_dir, verifier)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"id": f"q{i}", "messages": [{"role": "user", "content": "Why is it?"}]})
            + "\n"
            for i in range(4)
        )
    )
    params = Params.model_validate(
        {
            "verifier": {"source": "pretrained", "path": str(verifier)},
            "prepare": {"prompts": str(prompts)},
            "generate": {"chat_template_kwargs": {}},
        }
    )
    plain = estimates.estimate_tokens(params, None, None)
    tok = AutoTokenizer.from_pretrained(str(verifier))
    tok.chat_template = CHATML_DEFAULT_SYSTEM
    tok.save_pretrained(str(verifier))
    system = estimates.estimate_tokens(params, None, None)
    rendered = tok.apply_chat_template(
        [{"role": "user", "content": "Why is it?"}], tokenize=False, add_generation_prompt=True
    )
    n_tokens = len(tok(rendered, add_special_tokens=False)["input_ids"])
    assert f"~{n_tokens:,} prompt (mean, verifier's chat template)" in system.how[1]
    assert system.total == 4 * (n_tokens + params.generate.max_new_tokens)
    assert system.total > plain.total  # the default system prompt is counted
    (verifier / "tokenizer_config.json").unlink()
    assert (
        "chars/4; not templated: no tokenizer"
        in estimates.estimate_tokens(params, None, None).how[1]
    )
