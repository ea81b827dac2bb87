"""The whole DAG on a shrunken tiny profile, run by DVC in a fresh copy of the repo."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]

SMALL = {
    "verifier": {
        "tiny": {
            "train_steps": 60,
            "vocab_size": 1024,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
        }  # head_dim 32 for vLLM CPU
    },
    "prepare": {"max_prompts": 60, "val_ratio": 0.2},
    "generate": {"max_new_tokens": 32},
    "evaluate": {"max_eval_prompts": 6, "max_new_tokens": 24},
    "tokenize": {"max_seq_len": 128},
    "vocab": {"draft_vocab_size": 256},
    "train": {"epochs": 4, "max_tokens_per_batch": 512},
}


def _merge(base: dict, over: dict) -> dict:
    for k, v in over.items():
        base[k] = _merge(base.get(k, {}), v) if isinstance(v, dict) else v
    return base


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
    env.update(DVC_NO_ANALYTICS="1", HF_HUB_OFFLINE="1")
    return env


def _run(repo: Path, *cmd: str) -> str:
    proc = subprocess.run(cmd, cwd=repo, env=_env(), capture_output=True, text=True)
    assert proc.returncode == 0, f"{cmd} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = tmp_path_factory.mktemp("e2e") / "repo"
    files = subprocess.run(
        ["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    for f in files:
        (repo / f).parent.mkdir(parents=True, exist_ok=True)
        (repo / f).write_bytes((REPO / f).read_bytes())
    params = _merge(yaml.safe_load((repo / "params.yaml").read_text()), SMALL)
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    _run(repo, "git", "init", "-q")
    _run(repo, "git", "add", "-A")
    _run(repo, "git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "init")
    _run(repo, "dvc", "repro")
    return repo


def test_store_shapes_and_layer_ids(pipeline: Path) -> None:
    from safetensors.torch import load_file

    manifest = json.loads((pipeline / "data/hidden_states/manifest.json").read_text())
    assert manifest["layer_ids"] == [2, 4, 5, 8] and manifest["final_layer_id"] == 8
    rows = {}
    for split in ("train", "val"):
        for line in (pipeline / f"data/tokenized/{split}.jsonl").read_text().splitlines():
            r = json.loads(line)
            rows[r["id"]] = r
    assert set(manifest["samples"]) == set(rows)
    for sid, entry in list(manifest["samples"].items())[:10]:
        t = load_file(str(pipeline / "data/hidden_states" / entry["file"]))
        assert t["hidden_states"].shape == (len(rows[sid]["input_ids"]), 4, 64)
        assert t["token_ids"].tolist() == rows[sid]["input_ids"]
        assert entry["num_tokens"] == len(rows[sid]["input_ids"])


def test_generated_and_tokenized(pipeline: Path) -> None:
    rows = [
        json.loads(x) for x in (pipeline / "data/generated/train.jsonl").read_text().splitlines()
    ]
    assert rows and all(r["reasoning"] is not None for r in rows)
    tok = [
        json.loads(x) for x in (pipeline / "data/tokenized/train.jsonl").read_text().splitlines()
    ]
    assert all(len(r["input_ids"]) == len(r["loss_mask"]) <= 128 for r in tok)
    assert all(0 < sum(r["loss_mask"]) < len(r["loss_mask"]) for r in tok)


def test_metrics_are_sane(pipeline: Path) -> None:
    vocab = json.loads((pipeline / "metrics/vocab.json").read_text())
    assert 0.5 < vocab["coverage"] <= 1.0 and vocab["draft_vocab_size"] == 256
    ev = json.loads((pipeline / "metrics/eval.json").read_text())
    trained, untrained = ev["offline"]["trained"], ev["offline"]["untrained"]
    assert 1.0 <= untrained["mean_acceptance_length"] < 1.2
    assert trained["mean_acceptance_length"] > untrained["mean_acceptance_length"] + 0.3
    assert trained["mean_acceptance_length"] <= 4.0 and trained["num_drafts"] > 100
    online = ev["online"]  # the default profile serves the drafter with vLLM
    assert ev["greedy_outputs_identical"] is True
    assert 1.0 <= online["mean_acceptance_length"] <= 4.0 and online["num_prompts"] == 6
    assert online["mean_acceptance_length"] > untrained["mean_acceptance_length"]
    per_pos = trained["acceptance_per_position"]
    assert per_pos == sorted(per_pos, reverse=True)  # a chain: later positions need earlier ones
    train = json.loads((pipeline / "metrics/train.json").read_text())
    assert 0 <= train["best_epoch"] < 4
    loss = (pipeline / "metrics/train/plots/metrics/train/loss.tsv").read_text().splitlines()
    assert loss[0] == "step\tloss" and len(loss) > 5
    assert float(loss[-1].split()[1]) < float(loss[1].split()[1])  # training lowered the loss


def test_drafter_config(pipeline: Path) -> None:
    cfg = json.loads((pipeline / "models/drafter/config.json").read_text())
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert cfg["draft_vocab_size"] == 256
    assert cfg["norm_before_fc"] is True and cfg["norm_output"] is True
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == "data/verifier"
    assert "auto_map" not in cfg


def test_second_repro_is_noop_and_deps_are_per_stage(pipeline: Path) -> None:
    out = _run(pipeline, "dvc", "repro")
    assert "Running stage" not in out
    assert "Data and pipelines are up to date" in _run(pipeline, "dvc", "status")
    train_py = pipeline / "src/eagle3_pipeline/stages/train.py"
    original = train_py.read_text()
    try:
        train_py.write_text(original + "\n# an edit to training code\n")
        status = json.loads(_run(pipeline, "dvc", "status", "--json"))
        assert "train" in status
        assert not {"verifier", "prepare", "generate", "tokenize", "extract", "vocab"} & set(status)
        dry = _run(pipeline, "dvc", "repro", "--dry", "--force-downstream")
        ran = {
            s
            for s in ("extract", "train", "export", "evaluate")
            if f"stage '{s}'" in dry and f"Running stage '{s}'" in dry
        }
        assert ran == {"train", "export", "evaluate"}
    finally:
        train_py.write_text(original)
