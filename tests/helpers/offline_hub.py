"""Make any Hugging Face hub access fail loudly, in this process or in every child process.

A verifier name is a label: weights, config and tokenizer come from `verifier.path`. These
helpers turn a hidden hub lookup (which `HF_HUB_OFFLINE=1` reports only as a missing cache entry,
and which without it would start a download) into an unmistakable error.
"""

from __future__ import annotations

from pathlib import Path

import pytest

MESSAGE = "hub access attempted"
UNREACHABLE_HUB_ID = "unreachable-org/no-such-verifier-7b"

_SITECUSTOMIZE = f'''
import huggingface_hub, huggingface_hub.file_download, huggingface_hub._snapshot_download

def _refuse(*args, **kwargs):
    raise RuntimeError("{MESSAGE}: " + repr(args[:2]))

for _mod in (huggingface_hub, huggingface_hub.file_download):
    _mod.hf_hub_download = _refuse
for _mod in (huggingface_hub, huggingface_hub._snapshot_download):
    _mod.snapshot_download = _refuse
'''


def forbid_hub(monkeypatch: pytest.MonkeyPatch) -> None:
    """In this process: every hub download entry point raises, also where a module bound it by
    name (`from huggingface_hub import hf_hub_download`) before this ran."""
    import sys

    import huggingface_hub

    def refuse(*args, **kwargs):
        raise RuntimeError(f"{MESSAGE}: {args[:2]!r}")

    originals = {huggingface_hub.hf_hub_download, huggingface_hub.snapshot_download}
    for module in list(sys.modules.values()):
        for name in ("hf_hub_download", "snapshot_download"):
            # __dict__, not getattr: a lazy module would import its attributes
            if getattr(module, "__dict__", {}).get(name) in originals:
                monkeypatch.setattr(module, name, refuse)


def sitecustomize_dir(root: Path) -> Path:
    """A folder to put first on PYTHONPATH: child processes (stages, vLLM) refuse the hub too."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "sitecustomize.py").write_text(_SITECUSTOMIZE)
    return root
