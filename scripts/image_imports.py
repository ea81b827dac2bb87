"""`make image-imports`: what the image imports, in a venv installed from locks/cuda.txt.

Runs on a CPU machine too (CUDA wheels import without a GPU): vllm, speculators, torch, the vLLM
EAGLE-3 model classes, the stock hidden-states connector, speculators' trainer, and torch's
companions (torchvision, torchaudio, torchcodec), which transformers and vLLM import when present.
One line per module with its import time; exit 1 if any fails.
"""

from __future__ import annotations

import importlib
import sys
import time

MODULES = (
    "torch",
    "vllm",
    "speculators",
    "transformers",
    "dvc.repo",
    "dvclive",
    "vllm.model_executor.models.llama_eagle3",
    "vllm.model_executor.models.deepseek_eagle3",
    "vllm.model_executor.models.deepseek_v2",
    "vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector",
    "speculators.train.trainer",
    "hs_connectors.transfer",
    "mooncake.store",  # online mode's two-machine backend (libibverbs in the image)
    "ray",  # the cluster engine
    "ray.dashboard.modules.job.job_head",  # a KubeRay RayJob's job API (ray[default])
    "torchvision",
    "torchaudio",
    "torchcodec",
    "flashinfer",
)


def main() -> int:
    failed = 0
    t0 = time.monotonic()
    for name in MODULES:
        t = time.monotonic()
        try:
            module = importlib.import_module(name)
        except Exception as e:  # every failure is a finding: report it and go on
            failed += 1
            print(f"FAIL {name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
            continue
        version = getattr(module, "__version__", "")
        print(f"OK   {name} {version} ({time.monotonic() - t:.1f} s)", flush=True)
    import torch

    archs = " ".join(torch._C._cuda_getArchFlags().split())  # compiled-in, no GPU needed
    print(f"torch {torch.__version__} CUDA {torch.version.cuda}, kernels for {archs}")
    print(f"{len(MODULES) - failed}/{len(MODULES)} imported in {time.monotonic() - t0:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
