"""Imported by vLLM in each spawned worker serving an MLA model on CPU (`--worker-extension-cls`,
set by `cpu_patches.server_args_with_patches`): applies `fix_cpu_rope_multihead` there, before
the worker builds the model. Import it only in a vLLM worker: the import patches vLLM.
"""

from __future__ import annotations

from eagle3_pipeline.in_vllm.cpu_patches import fix_cpu_rope_multihead

fix_cpu_rope_multihead()


class CpuMlaRope:
    """No methods: vLLM mixes it into the worker class; the import above is the point."""
