"""extract with backend `vllm`: same store as the `hf` backend, layer for layer.

The vLLM test runs the real stage twice in a temp dir (hf, then vllm) on the same samples and
compares the stored files: token ids exactly, hidden states within bf16 rounding for every layer
id. Aux ids are listed out of order and include 0 (the embeddings) so that the one translation
between the conventions (vLLM returns layers in ascending order) is exercised. Without vLLM: the
layer order and length check (tests/unit/serving/test_hidden_states.py), resume after a kill
(tests/unit/stages/test_extract.py).
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
import torch
from extract_llama_case import AUX_IDS, N_LAYERS, make_params, write_tokenized

from eagle3_pipeline.config.params import Params
from eagle3_pipeline.serving import hidden_states as vllm_extract
from eagle3_pipeline.stages import extract
from eagle3_pipeline.store import format as store
from eagle3_pipeline.verifier.identity import read_verifier


@pytest.fixture(scope="module")
def verifier(tiny_verifier_dir: Path) -> Path:
    """The shared tiny verifier (head_dim 32, which vLLM's CPU attention needs)."""
    return tiny_verifier_dir


def _engine_kwargs(params: Params) -> dict:
    engine = vllm_extract.ExtractionEngine(
        read_verifier(params.verifier),
        params.vllm,
        params.extract.max_tokens_per_batch,
        params.seed,
    )
    return vllm_extract.engine_kwargs(engine, [*AUX_IDS, N_LAYERS], Path("scratch"))


@pytest.mark.vllm  # imports vLLM (through the CPU connector module)
def test_engine_kwargs_disable_prefix_caching_and_keep_chunked_prefill(verifier) -> None:
    params = make_params(verifier, "vllm")
    kw = _engine_kwargs(params)
    assert kw["enable_prefix_caching"] is False and "enable_chunked_prefill" not in kw
    spec = kw["speculative_config"]
    assert spec["method"] == "extract_hidden_states"
    hf_config = spec["draft_model_config"]["hf_config"]
    assert hf_config["eagle_aux_hidden_state_layer_ids"] == [0, 3, 5, 8]
    conn = kw["kv_transfer_config"]
    assert Path(conn["kv_connector_extra_config"]["shared_storage_path"]).is_absolute()
    assert kw["dtype"] == "float32"  # the verifier's own dtype, as the hf backend computes


@pytest.mark.vllm  # imports vLLM (through the connector module)
def test_connector_is_chosen_by_the_process_that_loads_it(monkeypatch, tmp_path) -> None:
    """The config names one class for every machine; vLLM's getattr in the serving process
    resolves it to that machine's: a CPU driver writing a GPU node's config names the right
    connector, and a driver with CUDA does not force the pinned-memory one on a CPU node."""
    import importlib

    from eagle3_pipeline.in_vllm import cpu_hs_connector as conn_module
    from eagle3_pipeline.serving.hidden_states import connector_config

    configs = []
    for cuda in (False, True):  # the driver's torch: must not matter
        monkeypatch.setattr(torch.cuda, "is_available", lambda cuda=cuda: cuda)
        configs.append(connector_config(tmp_path))
    assert configs[0] == configs[1]
    conn = configs[0]
    module = importlib.import_module(conn["kv_connector_module_path"])  # as vLLM's factory
    wanted = {False: "CPUHiddenStatesConnector", True: "ReportingHiddenStatesConnector"}
    for cuda, want in wanted.items():
        monkeypatch.setattr(torch.cuda, "is_available", lambda cuda=cuda: cuda)
        assert getattr(module, conn["kv_connector"]) is getattr(conn_module, want)
    with pytest.raises(AttributeError):
        module.NoSuchConnector  # noqa: B018


@pytest.mark.vllm  # imports vLLM's argument parser (~10-20 s)
def test_extra_args_cannot_turn_on_prefix_caching(verifier) -> None:
    params = make_params(verifier, "vllm")
    params.vllm.extra_args = ["--enable-prefix-caching", "--dtype", "bfloat16", "--api-key", "k"]
    kw = _engine_kwargs(params)
    assert kw["enable_prefix_caching"] is False and kw["dtype"] == "bfloat16"
    assert "api_key" not in kw  # a server-only flag


def _store(root: Path) -> tuple[dict, dict[str, dict[str, torch.Tensor]]]:
    manifest = store.read_manifest(root)
    return manifest, {s: store.read_sample(root, e) for s, e in manifest["samples"].items()}


@pytest.mark.vllm
def test_vllm_backend_matches_hf_backend(verifier, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    prompts = write_tokenized(tmp_path)
    t0 = time.monotonic()
    extract.run(make_params(verifier, "hf"))
    Path("data/hidden_states").rename("hf_store")
    t1 = time.monotonic()
    extract.run(make_params(verifier, "vllm"))
    t2 = time.monotonic()
    print(f"hf backend {t1 - t0:.1f} s, vllm backend {t2 - t1:.1f} s")

    ref_manifest, ref = _store(Path("hf_store"))
    manifest, got = _store(Path("data/hidden_states"))
    assert manifest["layer_ids"] == [*AUX_IDS, N_LAYERS] == ref_manifest["layer_ids"]
    assert manifest["num_samples"] == 6
    assert manifest["num_tokens"] == sum(len(p) for p in prompts.values())
    assert {k: v for k, v in manifest.items() if k != "samples"} == {
        k: v for k, v in ref_manifest.items() if k != "samples"
    }
    for sid, entry in manifest["samples"].items():
        assert entry["sha256"] == store.file_sha256(Path("data/hidden_states") / entry["file"])
        assert entry["split"] == ("val" if sid.startswith("val") else "train")
        assert entry["num_tokens"] == len(prompts[sid])
    assert not list(Path("data/.work/extract").glob("vllm/*"))  # connector files all moved

    worst = {lid: [0.0, 0.0] for lid in manifest["layer_ids"]}
    for sid, sample in got.items():
        assert sample["token_ids"].tolist() == prompts[sid] == ref[sid]["token_ids"].tolist()
        torch.testing.assert_close(sample["loss_mask"], ref[sid]["loss_mask"])
        for j, lid in enumerate(manifest["layer_ids"]):
            a = sample["hidden_states"][:, j].float()
            b = ref[sid]["hidden_states"][:, j].float()
            torch.testing.assert_close(a, b, rtol=1.6e-2, atol=1e-3, msg=f"{sid} layer {lid}")
            diff = (a - b).abs().max().item()
            worst[lid][0] = max(worst[lid][0], diff)
            worst[lid][1] = max(worst[lid][1], diff / b.abs().max().item())
    for lid, (abs_d, rel_d) in worst.items():
        print(f"layer id {lid}: max abs diff {abs_d:.3g}, max diff / max |x| {rel_d:.3g}")
    _check_final_is_before_norm(verifier, prompts, got)

    # Chunked prefill: a 32-token step budget splits the 33-61-token samples over several
    # steps; the connector still writes every token's hidden states, as the hf backend has them.
    Path("data/hidden_states").rename("vllm_store")
    shutil.rmtree("data/.work/extract", ignore_errors=True)  # nothing reused: all recomputed
    chunked = make_params(verifier, "vllm")
    chunked.vllm.extra_args = [*chunked.vllm.extra_args, "--max-num-batched-tokens", "32"]
    chunked.vllm.extra_args += ["--max-num-seqs", "4"]
    extract.run(chunked)
    _, got_chunked = _store(Path("data/hidden_states"))
    for sid, sample in got_chunked.items():
        assert sample["token_ids"].tolist() == prompts[sid]
        for j, lid in enumerate(manifest["layer_ids"]):
            a = sample["hidden_states"][:, j].float()
            b = ref[sid]["hidden_states"][:, j].float()
            torch.testing.assert_close(a, b, rtol=1.6e-2, atol=1e-3, msg=f"{sid} layer {lid}")


def _check_final_is_before_norm(verifier: Path, prompts, got) -> None:
    """Id N is the last layer's output before the norm, not transformers' hidden_states[N]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(verifier).eval()
    sid = max(prompts, key=lambda s: len(prompts[s]))
    with torch.no_grad():
        out = model(input_ids=torch.tensor([prompts[sid]]), output_hidden_states=True)
    final = got[sid]["hidden_states"][:, -1].float()
    post_norm = out.hidden_states[N_LAYERS][0]
    assert not torch.allclose(final, post_norm, rtol=0.1, atol=0.1)
    logits = model.lm_head(model.model.norm(final))
    torch.testing.assert_close(logits, out.logits[0], rtol=0.05, atol=0.05)
    for j, lid in enumerate(AUX_IDS):
        aux = got[sid]["hidden_states"][:, j].float()
        torch.testing.assert_close(aux, out.hidden_states[lid][0], rtol=1.6e-2, atol=1e-3)
