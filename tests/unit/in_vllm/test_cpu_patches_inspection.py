"""On CPU, vLLM inspects a model class in this process (`cpu_patches.inspect_models_in_process`):
no subprocess, and the same answer and cache file as vLLM's own subprocess gives."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.mark.vllm
def test_a_model_class_is_inspected_in_process_with_vllms_own_answer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vllm.model_executor.models import registry

    from eagle3_pipeline.in_vllm import cpu_patches

    model = registry._LazyRegisteredModel(
        module_name="vllm.model_executor.models.llama", class_name="LlamaForCausalLM"
    )
    cache_file = Path("modelinfos") / model._get_cache_filename()

    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "stock"))  # a cold cache
    stock = model.inspect_model_cls()  # vLLM's subprocess

    monkeypatch.setattr(registry, "_run_in_subprocess", registry._run_in_subprocess)  # restored
    cpu_patches.inspect_models_in_process()

    def no_subprocess(*args, **kwargs):  # noqa: ANN002, ANN003 - subprocess.run's
        raise AssertionError(f"a subprocess was started: {args}")

    monkeypatch.setattr(registry.subprocess, "run", no_subprocess)
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "patched"))  # cold again
    patched = model.inspect_model_cls()

    assert patched == stock
    assert (tmp_path / "patched" / cache_file).read_bytes() == (
        tmp_path / "stock" / cache_file
    ).read_bytes()


def test_only_the_cpu_platform_inspects_in_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """An accelerator keeps vLLM's subprocess (importing a model there could initialize CUDA)."""
    from eagle3_pipeline.in_vllm import cpu_patches

    calls: list[str] = []
    monkeypatch.setattr(cpu_patches, "inspect_models_in_process", lambda: calls.append("in"))
    cpu_patches.patch_in_process("unused-model-dir", on_cpu=False)
    assert calls == []
    cpu_patches.patch_in_process("unused-model-dir", on_cpu=True)
    assert calls == ["in"]
