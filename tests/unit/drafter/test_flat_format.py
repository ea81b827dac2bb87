"""The flat EAGLE-3 layout: our export, read back by speculators' own flat -> speculators tool."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from builders import model_files
from drafter_fixtures import build_drafter, build_llama_verifier
from safetensors.torch import load_file

from eagle3_pipeline.core.errors import CheckpointError
from eagle3_pipeline.drafter import flat_format as ff

AUX = [2, 4, 5]
DRAFT_IDS = list(range(3, 200))
# Fields of transformer_layer_config that decide the drafter's function.
LAYER_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "rms_norm_eps",
    "vocab_size",
    "attention_bias",
    "mlp_bias",
    "num_hidden_layers",
)


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """For both wirings (speculators' trainer flags, legacy flags): the bf16 checkpoint training
    writes, our flat export of it, and speculators' conversion of that export."""
    from speculators.convert.eagle.eagle3_converter import Eagle3Converter

    root = tmp_path_factory.mktemp("flat")
    verifier = build_llama_verifier(root / "verifier")
    out: dict[str, Any] = {"verifier": verifier}
    for name, legacy in (("trainer", False), ("legacy", True)):
        model = build_drafter(verifier, DRAFT_IDS, AUX, seed=4, legacy_flags=legacy)
        model.to(torch.bfloat16).save_pretrained(root / name / "spec")
        flat_dir = root / name / "flat"
        flat_dir.mkdir()
        flat = ff.write_flat(root / name / "spec", flat_dir, "vllm")
        # The converter reads neither the aux ids nor norm_before_residual from a flat config:
        # both are its arguments (speculators/convert/eagle/eagle3_converter.py).
        Eagle3Converter().convert(
            flat_dir,
            root / name / "back",
            base_model=str(verifier),
            validate=False,
            norm_before_residual=flat["norm_before_residual"],
            eagle_aux_hidden_state_layer_ids=flat["eagle_config"][
                "eagle_aux_hidden_state_layer_ids"
            ],
        )
        out[name] = root / name
    return out


def _config(path: Path) -> dict[str, Any]:
    return json.loads((path / "config.json").read_text())


@pytest.mark.parametrize("wiring", ["trainer", "legacy"])
def test_speculators_converter_gives_back_identical_tensors(
    converted: dict[str, Any], wiring: str
) -> None:
    src = load_file(str(converted[wiring] / "spec" / "model.safetensors"))
    flat = load_file(str(converted[wiring] / "flat" / "model.safetensors"))
    back = load_file(str(converted[wiring] / "back" / "model.safetensors"))
    assert "midlayer.self_attn.q_proj.weight" in flat and not any(
        k.startswith("layers.") for k in flat
    )
    dropped = set(src) - set(back)
    if wiring == "trainer":
        # speculators 0.9.0's converter builds its legacy Eagle3Speculator, which has no
        # input_norm: it drops that weight (while keeping norm_before_fc true). Our own reader
        # keeps it (test_our_reader_is_the_exact_inverse).
        assert dropped == {"input_norm.weight"}
    else:
        assert dropped == set()
    assert set(back) <= set(src)
    for name, tensor in back.items():
        assert src[name].dtype == tensor.dtype and torch.equal(src[name], tensor), name


@pytest.mark.parametrize("wiring", ["trainer", "legacy"])
def test_speculators_converter_gives_back_an_equivalent_config(
    converted: dict[str, Any], wiring: str
) -> None:
    src = _config(converted[wiring] / "spec")
    back = _config(converted[wiring] / "back")
    for key in LAYER_FIELDS:
        assert back["transformer_layer_config"][key] == src["transformer_layer_config"][key], key
    assert (
        back["transformer_layer_config"]["rope_parameters"]
        == src["transformer_layer_config"]["rope_parameters"]
    )
    for key in ("draft_vocab_size", "eagle_aux_hidden_state_layer_ids", *ff.FLAGS):
        assert back[key] == src[key], key
    assert src["norm_output"] is (wiring == "trainer")


def test_flat_config_carries_what_vllm_reads(converted: dict[str, Any]) -> None:
    flat = _config(converted["trainer"] / "flat")
    assert flat["architectures"] == ["LlamaForCausalLMEagle3"]
    assert flat["eagle_config"] == {
        "eagle_aux_hidden_state_layer_ids": AUX,
        "use_aux_hidden_state": True,
    }
    # vLLM's ids also at the top level: Model Runner V2 never reads eagle_config's key.
    assert flat["eagle_aux_hidden_state_layer_ids"] == AUX
    assert {k: flat[k] for k in ff.FLAGS} == {
        "norm_before_residual": True,
        "norm_before_fc": True,
        "fc_norm": False,
        "norm_output": True,
    }
    src = _config(converted["trainer"] / "spec")["transformer_layer_config"]
    # The sliding window speculators trains with (vLLM's llama attention reads layer_types).
    assert flat["layer_types"] == src["layer_types"] and flat["sliding_window"] == 2048
    assert flat["draft_vocab_size"] == len(DRAFT_IDS) and flat["vocab_size"] == src["vocab_size"]


def test_our_reader_is_the_exact_inverse(converted: dict[str, Any]) -> None:
    spec_dir = converted["trainer"] / "spec"
    src = load_file(str(spec_dir / "model.safetensors"))
    ckpt = ff.open_checkpoint(converted["trainer"] / "flat")
    assert ckpt.format == "flat" and ckpt.names() == sorted(src)
    for name, tensor in src.items():
        assert torch.equal(ckpt.tensor(name), tensor), name
    back = ff.to_speculators_config(_config(converted["trainer"] / "flat"), "verifier")
    want = _config(spec_dir)
    for key in ("draft_vocab_size", "eagle_aux_hidden_state_layer_ids", *ff.FLAGS):
        assert back[key] == want[key], key
    for key in (*LAYER_FIELDS, "rope_parameters", "layer_types", "sliding_window"):
        assert back["transformer_layer_config"][key] == want["transformer_layer_config"][key]


def test_server_id_conventions() -> None:
    assert ff.server_layer_ids([2, 30, 58], "vllm") == [2, 30, 58]
    # SGLang captures before layer id + 1: its id s is our s + 1.
    assert ff.server_layer_ids([2, 30, 58], "sglang") == [1, 29, 57]
    assert ff.vllm_layer_ids([2, 30, 58], "sglang") == [3, 31, 59]  # AQ-MedAI's file, in ours
    with pytest.raises(CheckpointError, match="aux id 0"):
        ff.server_layer_ids([0, 4, 5], "sglang")


def test_sglang_export_writes_sglang_ids(converted: dict[str, Any], tmp_path: Path) -> None:
    """A legacy-wired drafter is servable by SGLang: ids shifted, read back as ours."""
    out = tmp_path / "flat"
    out.mkdir()
    config = ff.write_flat(
        converted["legacy"] / "spec",
        out,
        "sglang",
        {"eagle3_pipeline": {"layer_convention": "sglang"}},
    )
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    ckpt = ff.open_checkpoint(out)
    assert ckpt.aux_layer_ids == [1, 3, 4] and ckpt.vllm_aux_layer_ids == AUX
    assert ff.to_speculators_config(_config(out), "v")["eagle_aux_hidden_state_layer_ids"] == AUX
    # vLLM (either model runner) reads the top level first: our ids, not SGLang's.
    assert config["eagle_aux_hidden_state_layer_ids"] == AUX
    edited = _config(out) | {"eagle_aux_hidden_state_layer_ids": [1, 3, 4]}
    with pytest.raises(CheckpointError, match="disagree with eagle_config"):
        ff.read_conventions(edited, out / "config.json")


def test_sglang_refuses_what_it_cannot_compute(converted: dict[str, Any], tmp_path: Path) -> None:
    out = tmp_path / "flat"
    out.mkdir()
    with pytest.raises(CheckpointError) as err:
        ff.write_flat(converted["trainer"] / "spec", out, "sglang")
    msg = str(err.value)
    assert "norm_before_residual=true, norm_before_fc=true, norm_output=true" in msg
    assert "export.server: vllm" in msg and "\n" not in msg
    assert list(out.iterdir()) == []  # nothing half-written
    flags = dict.fromkeys(ff.FLAGS, False)
    with pytest.raises(CheckpointError, match="4 aux layers"):
        ff.check_server(flags, 4, 1, False, "sglang", "x")
    with pytest.raises(CheckpointError, match="an input_norm weight"):
        ff.check_server(flags, 3, 1, True, "sglang", "x")
    ff.check_server(flags, 3, 1, False, "sglang", "x")
    ff.check_server(dict.fromkeys(ff.FLAGS, True), 4, 2, True, "vllm", "x")


def test_unknown_layouts_are_refused(tmp_path: Path) -> None:
    model_files(tmp_path, config={"architectures": ["LlamaForCausalLM"]})
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(1)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="neither a speculators drafter"):
        ff.open_checkpoint(tmp_path)
