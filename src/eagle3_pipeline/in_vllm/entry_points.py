"""Every name by which vLLM, or a process the pipeline starts, loads code from this wing.

The modules of in_vllm/ run inside vLLM's processes or patch vLLM: the server's entry and
watchdog, the API key middleware, the CPU patches with the worker extensions that apply them in
spawned workers, and the KV connectors that hand hidden states out. vLLM finds them by dotted
name in its arguments (`-m`, `--middleware`, `--worker-extension-cls`,
`kv_connector_module_path`), so a renamed module would fail only inside a server. Code outside
the wing uses these constants, never a name of its own (tests/unit/in_vllm/test_entry_points.py
imports each one and finds no other); harness/stage_deps.py reads them as dependencies, so a stage
that starts vLLM depends on every module vLLM may load from here.
"""

from __future__ import annotations

SERVER_ENTRY = "eagle3_pipeline.in_vllm.server_entry"  # `python -m`: the watchdog and the server
AUTH_MIDDLEWARE = "eagle3_pipeline.in_vllm.auth.RequireKey"  # the server's --middleware
HIDDEN_STATES_CONNECTOR = "eagle3_pipeline.in_vllm.cpu_hs_connector"  # kv_connector_module_path
MOONCAKE_CONNECTOR = "eagle3_pipeline.in_vllm.cpu_mooncake_connector"  # kv_connector_module_path
MLA_WORKER = "eagle3_pipeline.in_vllm.cpu_mla_worker.CpuMlaRope"  # --worker-extension-cls
MLA_DRAFTER_WORKER = "eagle3_pipeline.in_vllm.mla_drafter_worker.MlaDrafterBlockSize"

ALL = (
    SERVER_ENTRY,
    AUTH_MIDDLEWARE,
    HIDDEN_STATES_CONNECTOR,
    MOONCAKE_CONNECTOR,
    MLA_WORKER,
    MLA_DRAFTER_WORKER,
)
