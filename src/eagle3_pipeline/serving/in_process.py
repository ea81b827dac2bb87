"""vLLM's engine inside this process, started one way for extract and for synthesize.

Both run `vllm.LLM` from `server_spec.model_args` plus the engine flags of params.vllm.extra_args
(`engine_overrides`), after the CPU kernel-rebind patch and, for an MLA verifier on CPU, the
rope fix (in_vllm/): in this process, not in spawned workers, so the patches reach the engine.
The in-process engine core and the servers' environment (offline, caches in the workspace) are
set only while it starts and restored after, so servers this process starts later (tests) do not
inherit VLLM_ENABLE_V1_MULTIPROCESSING=0.
"""

from __future__ import annotations

from typing import Any

from eagle3_pipeline.core import environment
from eagle3_pipeline.core.progress import log
from eagle3_pipeline.in_vllm import cpu_patches
from eagle3_pipeline.in_vllm.server_entry import patch_cpu_kernel_rebind
from eagle3_pipeline.serving.server import server_env


def engine_overrides(extra_args: list[str], stage: str) -> dict[str, Any]:
    """Engine arguments among params.vllm.extra_args (server-only flags are skipped)."""
    if not extra_args:
        return {}
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    defaults = vars(parser.parse_known_args([])[0])
    given, unknown = parser.parse_known_args(extra_args)
    if unknown:
        log(stage, f"vllm.extra_args not used by the in-process engine: {unknown}")
    return {k: v for k, v in vars(given).items() if v != defaults.get(k)}


def start(kwargs: dict[str, Any], verifier_path: str) -> Any:
    """`vllm.LLM(**kwargs)`, patched and in its start-up environment (see above)."""
    from vllm import LLM

    patch_cpu_kernel_rebind()
    cpu_patches.patch_in_process(verifier_path)  # MLA on CPU: the rope fix
    wanted = server_env({"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    with environment.restored(set_to=wanted):
        return LLM(**kwargs)
