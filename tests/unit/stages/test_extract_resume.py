"""extract survives SIGKILL: the rerun extracts only what the journal lacks, same bytes as one run.

The stage runs as `eagle3 extract` in a subprocess (hf backend, the tiny verifier) in a temp dir
laid out like the repo, is SIGKILLed once its journal shows progress, and is run again.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from eagle3_pipeline import resume
from eagle3_pipeline.params import Params
from eagle3_pipeline.stages import extract
from eagle3_pipeline.store import format as store

EAGLE3 = str(Path(sys.executable).with_name("eagle3"))
AUX, FINAL = [2, 4, 5], 8


def make_workdir(
    root: Path, verifier: Path, n_samples: int, max_tokens: int, dtype: str = "bf16"
) -> dict[str, list[int]]:
    """params.yaml, data/verifier (a link) and data/tokenized/; returns id -> input_ids."""
    root.mkdir(parents=True, exist_ok=True)
    params = {
        "verifier": {"source": "pretrained", "path": "data/verifier"},
        "layers": {"aux_layer_ids": AUX, "final_layer_id": FINAL},
        "extract": {"backend": "hf", "max_tokens_per_batch": max_tokens, "store_dtype": dtype},
    }
    (root / "params.yaml").write_text(yaml.safe_dump(params))
    (root / "data/tokenized").mkdir(parents=True)
    (root / "data/verifier").symlink_to(verifier)
    gen = torch.Generator().manual_seed(1)
    out: dict[str, list[int]] = {}
    rows: dict[str, list[dict]] = {"train": [], "val": []}
    for k in range(n_samples):
        split = "val" if k % 10 == 0 else "train"
        n = int(torch.randint(8, 160, (1,), generator=gen))
        sid = f"{split}-{k:04d}"
        ids = torch.randint(10, 1000, (n,), generator=gen).tolist()
        rows[split].append(
            {"id": sid, "input_ids": ids, "loss_mask": [0, 0] + [1] * (n - 2), "split": split}
        )
        out[sid] = ids
    for split, rs in rows.items():
        (root / "data/tokenized" / f"{split}.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in rs)
        )
    return out


def load_params(root: Path) -> Params:
    return Params.model_validate(yaml.safe_load((root / "params.yaml").read_text()))


def store_hashes(root: Path) -> tuple[bytes, dict[str, str]]:
    """The manifest's bytes and every file's sha256, re-hashed from disk."""
    store_dir = root / "data/hidden_states"
    manifest = store.read_manifest(store_dir)
    hashes = {
        e["file"]: resume.file_sha256(store_dir / e["file"]) for e in manifest["samples"].values()
    }
    for e in manifest["samples"].values():
        assert hashes[e["file"]] == e["sha256"]
    return (store_dir / store.MANIFEST).read_bytes(), hashes


def _run_cli(cwd: Path) -> str:
    done = subprocess.run(
        [EAGLE3, "extract"], cwd=cwd, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.mark.slow
def test_sigkill_then_rerun_finishes_the_rest_with_identical_bytes(
    tiny_verifier_dir: Path, tmp_path: Path
) -> None:
    n, budget = 120, 240
    prompts = make_workdir(tmp_path / "ref", tiny_verifier_dir, n, budget)
    make_workdir(tmp_path / "run", tiny_verifier_dir, n, budget)
    batches = extract.token_budget_batches({s: len(p) for s, p in prompts.items()}, budget)
    biggest = max(len(b) for b in batches)
    assert len(batches) > 30  # enough batches that the kill lands mid-run

    _run_cli(tmp_path / "ref")

    work = tmp_path / "run"
    journal = work / "data/.work/extract" / extract.JOURNAL
    proc = subprocess.Popen(
        [EAGLE3, "extract"], cwd=work, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if journal.exists() and journal.read_bytes().count(b"\n") >= 5:
            break
        time.sleep(0.01)
    assert proc.poll() is None, "extract ended before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()

    journaled = {e["id"] for e in resume.Journal(journal).read()}
    on_disk = {p.name.removesuffix(".safetensors") for p in journal.parent.glob("*.safetensors")}
    assert 0 < len(journaled) < n and journaled <= on_disk
    assert len(on_disk - journaled) <= biggest  # at most the batch in flight is lost
    assert not (work / "data/hidden_states").exists()  # nothing half-published

    out = _run_cli(work)
    redo = int(re.search(r"(\d+) samples to extract", out).group(1))
    assert redo == n - len(journaled)  # nothing journaled is extracted again
    assert store_hashes(work) == store_hashes(tmp_path / "ref")
    scratch = journal.parent
    assert not list(scratch.glob("*.safetensors")) and not list(scratch.glob("entries*.jsonl"))
    assert not list(scratch.glob(".*.tmp"))


def _fake_backend(calls: list[int]):
    """Deterministic stand-in for the model: hidden states derived from the token ids."""

    def run_batch(batch: list[list[int]]) -> list[torch.Tensor]:
        calls.append(len(batch))
        return [
            torch.tensor(ids, dtype=torch.float32)[:, None, None].expand(-1, 4, 64).clone()
            for ids in batch
        ]

    import contextlib

    return lambda *_args: contextlib.nullcontext(run_batch)


def test_damaged_scratch_file_is_extracted_again(
    tiny_verifier_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """A journaled file truncated or altered afterwards is re-extracted, never published."""
    make_workdir(tmp_path, tiny_verifier_dir, 30, 200)
    monkeypatch.chdir(tmp_path)
    params = load_params(tmp_path)
    calls: list[int] = []
    monkeypatch.setattr(extract, "open_backend", _fake_backend(calls))
    extract.run(params, shard=(0, 2))  # scratch work that a later run reuses
    scratch = Path("data/.work/extract")
    entries = resume.Journal(scratch / extract.journal_name((0, 2))).read()
    truncated, altered = scratch / entries[0]["file"], scratch / entries[-1]["file"]
    truncated.write_bytes(truncated.read_bytes()[:100])
    data = bytearray(altered.read_bytes())
    data[-1] ^= 1
    altered.write_bytes(bytes(data))
    capsys.readouterr()
    extract.run(params)
    log = capsys.readouterr().out
    assert f"{truncated}: does not match its journal entry" in log
    assert f"{altered}: does not match its journal entry" in log
    manifest = store.read_manifest(Path("data/hidden_states"))
    assert manifest["num_samples"] == 30
    for entry in manifest["samples"].values():
        path = Path("data/hidden_states") / entry["file"]
        assert store.check_file(path.read_bytes(), entry, store.layout_of(manifest), None) == []


def test_preflight_refuses_when_the_disk_is_too_small(
    tiny_verifier_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from collections import namedtuple

    from eagle3_pipeline.errors import StoreError

    prompts = make_workdir(tmp_path, tiny_verifier_dir, 20, 200, dtype="fp8")
    monkeypatch.chdir(tmp_path)
    params = load_params(tmp_path)
    tokens = sum(len(p) for p in prompts.values())
    per_token = 4 * 64 + 4 * 4 + 16  # fp8 values + fp32 scale per layer + token id and mask
    need = tokens * per_token + params.extract.disk_headroom_gb * 1e9
    usage = namedtuple("usage", "total used free")
    calls: list[int] = []
    monkeypatch.setattr(extract, "open_backend", _fake_backend(calls))
    monkeypatch.setattr(extract.shutil, "disk_usage", lambda _p: usage(0, 0, int(need) - 1))
    with pytest.raises(StoreError) as err:
        extract.run(params)
    msg = str(err.value)
    assert f"{need / 1e9:,.1f} GB" in msg and "free" in msg and "data/.work/extract" in msg
    assert "store_dtype: fp8" in msg and "\n" not in msg
    assert calls == [] and not Path("data/hidden_states").exists()
    monkeypatch.setattr(extract.shutil, "disk_usage", lambda _p: usage(0, 0, int(need) + 1))
    extract.run(params)
    assert store.read_manifest(Path("data/hidden_states"))["num_tokens"] == tokens
