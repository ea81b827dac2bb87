"""verifier/identity.py: one custom-code check for the plan and the stages that load the model."""

from __future__ import annotations

from pathlib import Path

import pytest
from builders import fake_verifier

from eagle3_pipeline.config.params import load_params
from eagle3_pipeline.core import resume
from eagle3_pipeline.core.errors import VerifierError
from eagle3_pipeline.verifier import identity as vf

REPO = Path(__file__).resolve().parents[3]
TEXT = {"num_hidden_layers": 2, "hidden_size": 8, "vocab_size": 16}


@pytest.mark.parametrize(
    "config",
    [TEXT | {"auto_map": {"AutoConfig": "x.Y"}}, {"text_config": TEXT | {"auto_map": {"a": "b"}}}],
    ids=["top-level", "under-text_config"],
)
def test_custom_code_refused_unless_trusted(config: dict, tmp_path: Path) -> None:
    with pytest.raises(VerifierError, match=r"^elsewhere.json has auto_map"):
        vf.check_remote_code(config, False, "elsewhere.json")
    vf.check_remote_code(config, True, "elsewhere.json")
    # the facts a stage reads name the verifier's own config.json
    params = load_params(REPO / "profiles/tiny-llama.yaml")
    folder = fake_verifier(tmp_path / "verifier", config)
    untrusted = params.verifier.model_copy(update={"path": str(folder)})
    with pytest.raises(VerifierError, match=rf"^{folder}/config.json has auto_map"):
        vf.read_verifier(untrusted)
    trusted = params.verifier.model_copy(update={"path": str(folder), "trust_remote_code": True})
    assert vf.read_verifier(trusted).custom_code


def test_plain_config_needs_no_trust() -> None:
    assert not vf.has_custom_code(TEXT)
    vf.check_remote_code(TEXT, False, "config.json")


def test_facts_read_once_look_through_a_wrapper(tmp_path: Path) -> None:
    """A multimodal wrapper (Kimi-K2.5's shape): the text model's shape and type, the hash of
    config.json's bytes as written, the identity manifests record."""
    import hashlib

    wrapped = {"model_type": "kimi_k25", "text_config": TEXT | {"model_type": "deepseek_v3"}}
    folder = fake_verifier(tmp_path / "verifier", wrapped)
    params = load_params(REPO / "profiles/tiny-llama.yaml")
    v = params.verifier.model_copy(
        update={"path": str(folder), "name": "org/kimi", "revision": "r"}
    )
    facts = vf.read_verifier(v)
    assert (facts.num_layers, facts.hidden_size, facts.vocab_size) == (2, 8, 16)
    assert facts.model_type == "deepseek_v3" and facts.multimodal and not facts.custom_code
    sha = hashlib.sha256((folder / "config.json").read_bytes()).hexdigest()
    assert facts.identity == {"name_or_path": "org/kimi", "revision": "r", "config_sha256": sha}
    assert facts.shape_record["model_type"] == "deepseek_v3"
    plain = vf.read_verifier(
        v.model_copy(update={"path": str(fake_verifier(tmp_path / "p", TEXT))})
    )
    assert not plain.multimodal and plain.identity["name_or_path"] == "org/kimi"
    with pytest.raises(VerifierError, match="config.json: not found: run the 'verifier' stage"):
        vf.read_verifier(v.model_copy(update={"path": str(tmp_path / "missing")}))


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
    assert resume.files_stamp(one) != resume.files_stamp(two)  # why rows are not keyed on mtimes
    weights[-1] ^= 1
    (two / "model.safetensors").write_bytes(weights)
    assert vf.content_stamp(one) != vf.content_stamp(two)
    shutil.copy(one / "model.safetensors", two / "model.safetensors")
    fake_verifier(two, {"num_hidden_layers": 3})
    assert vf.content_stamp(one) != vf.content_stamp(two)
