"""verifier/identity.py: one custom-code check for the plan and the stages that load the model."""

from __future__ import annotations

from pathlib import Path

import pytest
from builders import fake_verifier

from eagle3_pipeline.config.params import load_params
from eagle3_pipeline.core.errors import VerifierError
from eagle3_pipeline.verifier import identity as vf

REPO = Path(__file__).resolve().parents[3]
TEXT = {"num_hidden_layers": 2, "hidden_size": 8, "vocab_size": 16}


@pytest.mark.parametrize(
    "config",
    [TEXT | {"auto_map": {"AutoConfig": "x.Y"}}, {"text_config": TEXT | {"auto_map": {"a": "b"}}}],
    ids=["top-level", "under-text_config"],
)
def test_custom_code_refused_unless_trusted(config: dict) -> None:
    params = load_params(REPO / "profiles/tiny-llama.yaml").model_copy(deep=True)
    params.verifier.trust_remote_code = False
    with pytest.raises(VerifierError, match=r"data/verifier/config.json has auto_map"):
        vf.check_remote_code(params, config)
    with pytest.raises(VerifierError, match=r"^elsewhere.json has auto_map"):
        vf.check_remote_code(params, config, "elsewhere.json")
    params.verifier.trust_remote_code = True
    vf.check_remote_code(params, config)


def test_plain_config_needs_no_trust() -> None:
    params = load_params(REPO / "profiles/tiny-llama.yaml")
    assert not vf.has_custom_code(TEXT)
    vf.check_remote_code(params, TEXT)


def test_content_stamp_is_the_same_on_every_machine_and_sees_new_weights(tmp_path: Path) -> None:
    """Keys rows across machines: a copy with other mtimes stamps alike; other bytes at either
    end of a large file, or in a small file, stamp otherwise."""
    import os
    import shutil

    one = fake_verifier(tmp_path / "one", {"num_hidden_layers": 2})
    weights = bytearray(os.urandom(3 * vf.STAMP_ENDS_BYTES))
    (one / "model.safetensors").write_bytes(weights)
    two = tmp_path / "two"
    shutil.copytree(one, two)
    os.utime(two / "model.safetensors", (0, 0))
    assert vf.content_stamp(one) == vf.content_stamp(two)
    assert vf.files_stamp(one) != vf.files_stamp(two)  # why rows are not keyed on mtimes
    weights[-1] ^= 1
    (two / "model.safetensors").write_bytes(weights)
    assert vf.content_stamp(one) != vf.content_stamp(two)
    shutil.copy(one / "model.safetensors", two / "model.safetensors")
    fake_verifier(two, {"num_hidden_layers": 3})
    assert vf.content_stamp(one) != vf.content_stamp(two)
