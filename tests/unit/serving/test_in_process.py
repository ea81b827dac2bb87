"""serving.in_process: the engine flags of params.vllm.extra_args reach vllm.LLM, server-only
flags are named and skipped."""

from __future__ import annotations

from eagle3_pipeline.serving import in_process


def test_engine_flags_pass_and_server_flags_are_named(capsys) -> None:
    got = in_process.engine_overrides(["--dtype", "bfloat16", "--port", "9"], "extract")
    assert got == {"dtype": "bfloat16"}
    assert (
        "vllm.extra_args not used by the in-process engine: ['--port', '9']"
        in capsys.readouterr().out
    )
    assert in_process.engine_overrides([], "synthesize") == {}
