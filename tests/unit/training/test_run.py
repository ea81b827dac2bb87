"""A speculators run from TrainSettings, against the real speculators 0.9.0 trainer."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from train_workspace import AUX_IDS, DRAFT_VOCAB, tiny_settings, train_tiny, verifier_head_rows

from eagle3_pipeline.config.training_params import TrainParams
from eagle3_pipeline.drafter.conventions import RunConventions
from eagle3_pipeline.training import checkpoints
from eagle3_pipeline.training.run import TrainingInterrupted, TrainSettings, build_train_config

# TrainParams fields that are not settings of a run, and where they go instead.
NOT_SETTINGS = {
    "log_every_steps": "log lines only (metrics.MetricsSink)",
    "nproc": "the launcher; with strategy, it decides fsdp",
    "strategy": "fsdp",
    "init_mismatch": "drafter.conventions (refuses or allows; the settings get its result)",
    "flags": "drafter.conventions -> the four flag fields (test_settings_carry_conventions)",
    "hidden_states": "the stage: online -> online_flags (test_online_flags_reach_speculators)",
    "online": "online_training.source.speculators_flags -> online_flags",
    "family": "as is (test_family_reaches_settings; excludes init_from, so not in NON_DEFAULT)",
    "init_from_verifier": "as is (test_init_from_verifier_reaches_settings; excludes init_from)",
}
# A value unlike the default for each carried field, so a forgotten one shows.
NON_DEFAULT = {
    "epochs": 7,
    "lr": 1e-4,
    "scheduler": "linear",
    "warmup_ratio": 0.2,
    "noise_std": 0.3,
    "ttt_steps": 5,
    "ttt_step_loss_decay": 0.8,
    "max_tokens_per_batch": 999,
    "num_workers": 2,
    "seed": 11,
    "init_from": "some/drafter",
    "init_vocab_mismatch": "refuse",
    "train_lm_head": False,
    "grad_accumulation": 4,
    "keep_last": 5,
    "cpu_dtype": "bfloat16",
}


FLAGS = {
    "norm_before_residual": True,
    "norm_before_fc": True,
    "fc_norm": False,
    "norm_output": True,
}


def _settings_from(
    t: TrainParams, conventions: RunConventions | None = None, nodes: int = 1
) -> TrainSettings:
    return TrainSettings.from_params(
        t,
        data_dir=Path("d"),
        save_dir=Path("s"),
        verifier_dir=Path("v"),
        vocab_dir=Path("data/vocab"),
        draft_vocab_size=DRAFT_VOCAB,
        conventions=conventions or RunConventions(AUX_IDS, 8, dict(FLAGS), {}),
        train_data_ratio=0.5,
        nodes=nodes,
    )


def test_settings_hold_the_train_params_given() -> None:
    """TrainSettings holds the TrainParams it was given: every knob, with params' one default;
    no settings field repeats a knob (a new knob needs no second default)."""
    assert set(TrainParams.model_fields) == set(NON_DEFAULT) | set(NOT_SETTINGS)
    defaults = TrainParams()
    for name, value in NON_DEFAULT.items():
        assert getattr(defaults, name) != value, f"NON_DEFAULT[{name!r}] is the default"
    t = TrainParams(**NON_DEFAULT)
    settings = _settings_from(t)
    assert settings.train is t
    fields = {f.name for f in dataclasses.fields(TrainSettings)}
    assert not fields & set(TrainParams.model_fields)
    assert settings.init_from == Path(NON_DEFAULT["init_from"])
    assert settings.d2t_path == Path("data/vocab/d2t.npy")
    assert settings.t2d_path == Path("data/vocab/t2d.npy")
    assert settings.metrics_every_steps == 1  # every step to DVCLive


def test_init_from_verifier_reaches_settings() -> None:
    settings = _settings_from(TrainParams(init_from_verifier=True))
    assert settings.train.init_from_verifier and settings.init_from is None


def test_family_reaches_settings() -> None:
    from eagle3_pipeline.config.families import FamilyParams

    family = FamilyParams(name="dflash", block_size=4)
    assert _settings_from(TrainParams(family=family)).train.family == family


def test_settings_carry_conventions(tmp_path: Path) -> None:
    """Ids, every flag and the init checkpoint's layer reach speculators' TrainConfig."""
    flags = {"norm_before_residual": False, "norm_before_fc": False, "fc_norm": True}
    layer = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 2, "head_dim": 48}
    conv = RunConventions([3, 5, 6], 8, flags | {"norm_output": False}, {}, layer)
    s = dataclasses.replace(_settings_from(TrainParams(), conv), save_dir=tmp_path / "ckpt")
    assert s.target_layer_ids == [3, 5, 6] and s.draft_layer_config == layer
    cfg = build_train_config(s).flatten()
    assert cfg["target_layer_ids"] == [3, 5, 6]
    for name, value in conv.flags.items():
        assert cfg[name] is value, name
    assert cfg["draft_config"] == str(tmp_path / "ckpt" / "draft_layer_config.json")
    default = build_train_config(_settings_from(TrainParams())).flatten()
    assert default["draft_config"] == "" and default["num_layers"] == 1
    assert {k: default[k] for k in FLAGS} == FLAGS


def test_settings_fsdp_only_with_processes() -> None:
    assert _settings_from(TrainParams(strategy="fsdp", nproc=2)).fsdp
    assert not _settings_from(TrainParams(strategy="fsdp", nproc=1)).fsdp
    assert _settings_from(TrainParams(strategy="fsdp", nproc=1), nodes=2).fsdp  # 2 nodes x 1
    assert not _settings_from(TrainParams(strategy="ddp", nproc=2)).fsdp
    assert _settings_from(TrainParams(init_from=None)).init_from is None


def test_train_config_carries_the_settings(inputs: dict[str, Any], tmp_path: Path) -> None:
    s = tiny_settings(inputs, tmp_path, epochs=4, lr=1e-4, seed=3, max_tokens_per_batch=300)
    cfg = build_train_config(s)
    dumped = json.dumps(cfg.model_dump(mode="json"))
    for value in ("0.0001", '"seed": 3', "300", str(s.save_dir), str(s.d2t_path)):
        assert value in dumped, value


def test_run_training_rejects_final_id_and_noise(inputs: dict[str, Any], tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="aux ids only"):
        train_tiny(inputs, tmp_path, target_layer_ids=[*AUX_IDS, 8])
    with pytest.raises(ValueError, match="noise"):
        train_tiny(inputs, tmp_path, noise_std=-0.1)
    assert not (tmp_path / "ckpt").exists()


def test_run_training_rejects_bad_knobs(inputs: dict[str, Any], tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="grad_accumulation"):
        train_tiny(inputs, tmp_path, grad_accumulation=0)
    with pytest.raises(ValueError, match="keep_last"):
        train_tiny(inputs, tmp_path, keep_last=0)
    with pytest.raises(ValueError, match="torchrun"):
        train_tiny(inputs, tmp_path, fsdp=True)


@pytest.mark.slow
def test_train_resume_and_best_checkpoint(inputs: dict[str, Any], tmp_path: Path) -> None:
    first = train_tiny(inputs, tmp_path, epochs=1)
    second = train_tiny(inputs, tmp_path, epochs=2)  # resumes after epoch 0
    save_dir = tmp_path / "ckpt"

    for epoch in (0, 1):
        for name in ("config.json", "model.safetensors", "optimizer_state_dict.pt"):
            assert (save_dir / str(epoch) / name).is_file()
    assert checkpoints.best_checkpoint(save_dir) in {save_dir / "0", save_dir / "1"}

    train = [(step, m["train"]) for step, m in first + second if "train" in m]
    assert [step for step, _ in train] == list(range(len(train)))
    assert {m["epoch"] for _, m in second} == {1}  # epoch 0 was not rerun
    for _, values in train:
        assert math.isfinite(values["loss"])
        assert {f"full_acc_{k}" for k in range(3)} <= values.keys()
    vals = [m["val"] for _, m in first + second if "val" in m]
    assert len(vals) == 2 and all(math.isfinite(v["loss_epoch"]) for v in vals)

    config = json.loads((save_dir / "1" / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == AUX_IDS
    assert config["norm_before_fc"] is True and config["norm_output"] is True
    assert config["draft_vocab_size"] == DRAFT_VOCAB
    assert config["transformer_layer_config"]["num_hidden_layers"] == 1
    verifier = config["speculators_config"]["verifier"]["name_or_path"]
    assert verifier == str(inputs["root"] / "verifier")

    # speculators keeps the draft lm_head frozen at the verifier's rows.
    weights = load_file(save_dir / "1" / "model.safetensors")
    assert torch.equal(weights["lm_head.weight"], verifier_head_rows(inputs))


@pytest.mark.slow
def test_signal_raises_training_interrupted(inputs: dict[str, Any], tmp_path: Path) -> None:
    def interrupt(metrics: dict, step: int) -> None:
        os.kill(os.getpid(), signal.SIGINT)  # speculators' handler catches it (as SIGTERM)

    # The handler before the run: Python's default, or SIG_IGN when started as a background job.
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(TrainingInterrupted):
        train_tiny(inputs, tmp_path, on_metrics=interrupt)
    assert (tmp_path / "ckpt" / "interrupted" / "model.safetensors").is_file()
    assert not (tmp_path / "ckpt" / "0").exists()
    assert signal.getsignal(signal.SIGINT) is before  # restored


def test_online_flags_reach_speculators(tmp_path: Path) -> None:
    """Online mode's flags, the Mooncake backend's included, reach speculators' config; without
    split_backend_flags its schema drops mooncake_* silently and uses 127.0.0.1:50051."""
    from eagle3_pipeline.config.training_params import OnlineParams
    from eagle3_pipeline.online_training.source import speculators_flags

    online = OnlineParams(backend="mooncake", request_timeout_s=7, max_retries=2)
    online.mooncake.master = "10.1.2.3:50099"
    flags = speculators_flags(online, "http://10.1.2.4:8000/v1")
    settings = dataclasses.replace(_settings_from(TrainParams()), online_flags=flags)
    cfg = build_train_config(settings).flatten()
    assert cfg["on_missing"] == "generate" and cfg["vllm_endpoint"] == "http://10.1.2.4:8000/v1"
    assert cfg["hidden_states_backend"] == "mooncake"
    assert cfg["mooncake_master"] == "10.1.2.3:50099"
    assert cfg["request_timeout"] == 7 and cfg["max_retries"] == 2
    assert cfg["max_consecutive_generation_failures"] == 1  # a refused sample stops the run
    store = build_train_config(_settings_from(TrainParams())).flatten()
    assert store["on_missing"] == "raise" and store["hidden_states_backend"] == "fp8"


def test_request_logs_are_quiet_in_training_unless_debugging(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import logging

    from eagle3_pipeline.core.errors import DEBUG_ENV
    from eagle3_pipeline.training.run import quiet_request_logs

    httpx_log = logging.getLogger("httpx2")  # openai 3's transport
    before = httpx_log.level
    monkeypatch.delenv(DEBUG_ENV, raising=False)
    with quiet_request_logs():
        assert not httpx_log.isEnabledFor(logging.INFO)
        assert httpx_log.isEnabledFor(logging.WARNING)
    assert httpx_log.level == before
    monkeypatch.setenv(DEBUG_ENV, "1")
    with quiet_request_logs():
        assert httpx_log.level == before
