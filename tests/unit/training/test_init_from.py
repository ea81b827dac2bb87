"""train.init_from: a legacy flat (AQ-MedAI-style) or speculators drafter onto the run's model."""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from builders import model_files, train_params
from drafter_fixtures import (
    HIDDEN,
    VOCAB,
    build_drafter,
    build_llama_verifier,
    save_legacy_flat,
)
from safetensors.torch import load_file, save_file

from eagle3_pipeline.core.errors import CheckpointError
from eagle3_pipeline.training import init_from as di

AUX = [2, 4, 5]  # ours (vLLM's); the legacy file writes [1, 3, 4] (SGLang's)
RUN_IDS = list(range(0, 256, 2)) + list(range(300, 364))  # 192 draft tokens
CKPT_IDS = list(range(0, 128)) + list(range(300, 332))  # 160 draft tokens
LAYER_TENSORS = 10  # midlayer: 3 norms, q/k/v/o, gate/up/down


@pytest.fixture(scope="module")
def verifier(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_llama_verifier(tmp_path_factory.mktemp("v") / "verifier")


@pytest.fixture(scope="module")
def legacy(verifier: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Legacy flat checkpoints: one with the run's own mapping, one with another mapping."""
    root = tmp_path_factory.mktemp("ckpt")
    out = {}
    for name, ids in (("same", RUN_IDS), ("other", CKPT_IDS)):
        model = build_drafter(verifier, ids, AUX, seed=1, legacy_flags=True)
        out[name] = save_legacy_flat(model, root / name, [i - 1 for i in AUX])
    return out


def run_model(verifier: Path, seed: int = 2):
    """The drafter speculators builds for this run (norm flags true), before training."""
    return build_drafter(verifier, RUN_IDS, AUX, seed=seed, random_head=False)


def test_same_mapping_loads_every_tensor(verifier: Path, legacy: dict[str, Any]) -> None:
    model = run_model(verifier)
    report = di.apply_init(model, legacy["same"], "refuse")
    saved = load_file(str(legacy["same"] / "model.safetensors"))
    state = model.state_dict()
    for flat_name, tensor in saved.items():
        name = flat_name.replace("midlayer.", "layers.0.")
        if name in ("d2t", "t2d"):
            continue
        assert torch.equal(state[name].to(torch.bfloat16), tensor), name
    # AQ-MedAI's shape of report: 13 tensors loaded, d2t/t2d skipped.
    assert len(report.loaded) == 1 + LAYER_TENSORS + 2 == 13
    assert set(report.skipped) == {"d2t", "t2d"}
    assert report.new == ["input_norm.weight"]  # the run has norm_before_fc, the file not
    assert report.from_verifier == [
        "embed_tokens.weight",
        "verifier_lm_head.weight",
        "verifier_norm.weight",
    ]
    assert "same vocab mapping" in report.lm_head
    params = list(model.parameters())
    assert report.total == sum(p.numel() for p in params)
    assert report.trainable == sum(p.numel() for p in params if p.requires_grad)
    assert report.frozen == report.total - report.trainable > 0
    text = "\n".join(report.lines())
    assert "norm_before_residual False -> True" in text
    # The file's [1, 3, 4] are SGLang ids: ours [2, 4, 5], the run's: no aux note.
    assert "aux layers" not in text


def test_remap_moves_rows_by_target_id(verifier: Path, legacy: dict[str, Any]) -> None:
    model = run_model(verifier)
    report = di.apply_init(model, legacy["other"], "remap")
    ckpt_head = load_file(str(legacy["other"] / "model.safetensors"))["lm_head.weight"]
    verifier_head = load_file(str(verifier / "model.safetensors"))["lm_head.weight"]
    head = model.lm_head.weight.detach()
    ckpt_row = {t: i for i, t in enumerate(sorted(CKPT_IDS))}
    for j, t in enumerate(sorted(RUN_IDS)):
        want = ckpt_head[ckpt_row[t]].float() if t in ckpt_row else verifier_head[t]
        assert torch.equal(head[j], want), (j, t)
    both = set(RUN_IDS) & set(CKPT_IDS)
    assert report.rows_kept == len(both) == 96
    assert report.rows_new == len(RUN_IDS) - len(both)
    assert report.rows_dropped == len(CKPT_IDS) - len(both)
    # The run's own mapping is untouched.
    assert (model.d2t + torch.arange(len(RUN_IDS))).tolist() == sorted(RUN_IDS)


def test_refuse_names_both_mappings(verifier: Path, legacy: dict[str, Any]) -> None:
    model = run_model(verifier)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError) as err:
        di.apply_init(model, legacy["other"], "refuse", run_mapping="data/vocab")
    msg = str(err.value)
    assert str(legacy["other"]) in msg and "data/vocab/d2t.npy" in msg
    assert "draft vocab 160" in msg and "draft vocab 192" in msg and "\n" not in msg
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def _variant(src: Path, dst: Path, config: dict | None = None, tensors: dict | None = None) -> Path:
    shutil.copytree(src, dst)
    if config:
        model_files(dst, config=json.loads((dst / "config.json").read_text()) | config)
    if tensors:
        weights = load_file(str(dst / "model.safetensors")) | tensors
        save_file(weights, str(dst / "model.safetensors"))
    return dst


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"config": {"hidden_size": 96}}, "hidden_size 96 but this run's verifier has 64"),
        (
            {"tensors": {"fc.weight": torch.zeros(HIDDEN, 4 * HIDDEN, dtype=torch.bfloat16)}},
            "4 aux layers",
        ),
        (
            {"tensors": {"t2d": torch.zeros(VOCAB * 2, dtype=torch.bool)}},
            "target vocab 1024 but this run's verifier has 512",
        ),
        (
            {"tensors": {"midlayer.mlp.up_proj.weight": torch.zeros(7, HIDDEN)}},
            "tensor layers.0.mlp.up_proj.weight has shape [7, 64]",
        ),
    ],
)
def test_refuses_another_verifiers_drafter(
    verifier: Path, legacy: dict[str, Any], tmp_path: Path, change: dict, words: str
) -> None:
    bad = _variant(legacy["same"], tmp_path / "bad", **change)
    with pytest.raises(CheckpointError, match=re.escape(words)):
        di.apply_init(run_model(verifier), bad, "remap")


def test_speculators_format_and_unknown_tensors(verifier: Path, tmp_path: Path) -> None:
    """A speculators checkpoint (ids in vLLM's convention) loads by its own names."""
    src = build_drafter(verifier, RUN_IDS, [1, 3, 6], seed=3)
    src.save_pretrained(tmp_path / "spec")
    _variant(tmp_path / "spec", tmp_path / "spec2", tensors={"extra.bias": torch.ones(3)})
    model = run_model(verifier)
    report = di.apply_init(model, tmp_path / "spec2", "refuse")
    assert report.format == "speculators"
    assert report.skipped["extra.bias"].startswith("not a parameter")
    assert "input_norm.weight" in report.loaded and "embed_tokens.weight" in report.loaded
    assert report.new == []
    assert torch.equal(model.fc.weight, src.fc.weight)
    assert "aux layers [1, 3, 6] in vLLM's convention; this run feeds [2, 4, 5]" in "\n".join(
        report.lines()
    )


def test_context_applies_once_and_never_on_resume(
    verifier: Path, legacy: dict[str, Any], tmp_path: Path
) -> None:
    lines: list[str] = []
    with di.init_from_checkpoint(legacy["same"], "refuse", tmp_path / "save", lines.append) as got:
        model = run_model(verifier)  # from_training_args ends with load_verifier_weights
        fc = model.fc.weight.detach().clone()
        model.load_verifier_weights()  # a second call (another load) must not re-apply
    assert len(got) == 1 and any("loaded 13 tensors" in line for line in lines)
    assert torch.equal(model.fc.weight, fc)
    saved_fc = load_file(str(legacy["same"] / "model.safetensors"))["fc.weight"]
    assert torch.equal(fc.to(torch.bfloat16), saved_fc)

    (tmp_path / "save" / "0").mkdir(parents=True)  # speculators will resume from epoch 0
    lines.clear()
    with di.init_from_checkpoint(legacy["same"], "refuse", tmp_path / "save", lines.append) as got:
        model = run_model(verifier)
    assert got == [] and "not applied: resuming from" in lines[0]
    assert not torch.equal(model.fc.weight.to(torch.bfloat16), saved_fc)


def test_missing_init_dir_fails_before_training(tmp_path: Path) -> None:
    with (
        pytest.raises(CheckpointError, match="config.json: not found"),
        di.init_from_checkpoint(tmp_path / "nope", "remap", tmp_path / "save", print),
    ):
        pass


@pytest.mark.slow
def test_real_training_starts_from_legacy_checkpoint(
    verifier: Path, legacy: dict[str, Any], tmp_path: Path
) -> None:
    """speculators' trainer, 1 epoch at a negligible lr: epoch 0 holds the checkpoint's weights
    (bf16, as both are saved); a second run resumes and leaves init_from alone."""
    from eagle3_pipeline.training.data import (
        TrainingSample,
        train_data_ratio_for,
        write_training_data,
    )
    from eagle3_pipeline.training.run import TrainSettings, run_training

    gen = torch.Generator().manual_seed(0)
    samples: list[TrainingSample] = []
    (tmp_path / "store").mkdir()
    for i in range(6):
        ids = torch.randint(0, VOCAB, (48,), generator=gen)
        path = tmp_path / "store" / f"s{i}.safetensors"
        hidden = torch.randn(48, len(AUX) + 1, HIDDEN, generator=gen).to(torch.bfloat16)
        save_file({"hidden_states": hidden, "token_ids": ids}, str(path))
        samples.append(
            {"input_ids": ids.tolist(), "loss_mask": [1] * 48, "hidden_states_file": path}
        )
    write_training_data(tmp_path / "data", samples)
    from drafter_fixtures import mapping

    d2t, t2d = mapping(RUN_IDS, VOCAB)
    np.save(tmp_path / "d2t.npy", d2t.numpy())
    np.save(tmp_path / "t2d.npy", t2d.numpy())
    save_dir = tmp_path / "ckpt"
    train = train_params(
        lr=1e-12,
        ttt_steps=2,
        max_tokens_per_batch=96,
        init_from=str(legacy["same"]),
        init_vocab_mismatch="refuse",
    )
    settings = TrainSettings(
        train=train,
        data_dir=tmp_path / "data",
        verifier_dir=verifier,
        save_dir=save_dir,
        d2t_path=tmp_path / "d2t.npy",
        t2d_path=tmp_path / "t2d.npy",
        draft_vocab_size=len(RUN_IDS),
        target_layer_ids=AUX,
        train_data_ratio=train_data_ratio_for(4, 6),
    )
    lines: list[str] = []
    run_training(settings, on_metrics=None, on_init_line=lines.append)
    assert any("loaded 13 tensors" in line for line in lines)
    trained = load_file(str(save_dir / "0" / "model.safetensors"))
    ckpt = load_file(str(legacy["same"] / "model.safetensors"))
    for flat_name, tensor in ckpt.items():
        name = flat_name.replace("midlayer.", "layers.0.")
        assert torch.equal(trained[name], tensor), name

    lines.clear()
    twice = replace(settings, train=train.model_copy(update={"epochs": 2}))
    run_training(twice, on_metrics=None, on_init_line=lines.append)
    assert lines and "resuming from" in lines[0]
    assert (save_dir / "1" / "model.safetensors").is_file()


def test_legacy_pytorch_bin_loads_like_safetensors(
    verifier: Path, legacy: dict[str, Any], tmp_path: Path
) -> None:
    """Older EAGLE-3 releases ship pytorch_model.bin instead of safetensors."""
    shutil.copy(legacy["same"] / "config.json", tmp_path / "config.json")
    torch.save(load_file(str(legacy["same"] / "model.safetensors")), tmp_path / "pytorch_model.bin")
    a, b = run_model(verifier), run_model(verifier)
    di.apply_init(a, legacy["same"], "refuse")
    report = di.apply_init(b, tmp_path, "refuse")
    assert len(report.loaded) == 13
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))
