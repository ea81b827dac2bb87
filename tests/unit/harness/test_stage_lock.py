"""One writer per stage output; a killed run's temp files swept at the next start of its stage."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from builders import model_files

from eagle3_pipeline.core import paths
from eagle3_pipeline.harness import stage_lock

REPO = Path(__file__).resolve().parents[3]
EAGLE3 = str(Path(sys.executable).with_name("eagle3"))
HOLDER = (
    "import sys, time\n"
    "from eagle3_pipeline.harness import stage_lock\n"
    "with stage_lock.hold(sys.argv[1]):\n"
    "    print('held', flush=True)\n"
    "    time.sleep(120)\n"
)


def _hold_in_child(cwd: Path, stage: str) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, stage], cwd=cwd, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_writer_is_refused_naming_the_holder_until_it_dies(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    proc = _hold_in_child(tmp_path, "train")
    try:
        with pytest.raises(stage_lock.StageBusyError) as err, stage_lock.hold("train"):
            pass
        msg = str(err.value)
        assert msg.startswith("train is already running (pid ") and f"pid {proc.pid} " in msg
        assert "since 20" in msg and "`-c train`" in msg and "\n" not in msg
        with stage_lock.hold("extract"):  # other stages are free
            pass
    finally:
        os.kill(proc.pid, signal.SIGKILL)  # a flock dies with its holder, SIGKILL included
        proc.wait()
    with stage_lock.hold("train"):
        assert json.loads(stage_lock.lock_path("train").read_text())["pid"] == os.getpid()


def test_shards_lock_apart(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with (
        stage_lock.hold("extract", (0, 2)),
        stage_lock.hold("extract", (1, 2)),
        pytest.raises(stage_lock.StageBusyError),
        stage_lock.hold("extract", (0, 2)),
    ):
        pass


def test_the_cli_refuses_a_stage_already_running(tmp_path: Path) -> None:
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({"prepare": {"prompts": "p.jsonl"}}))
    proc = _hold_in_child(tmp_path, "prepare")
    try:
        done = subprocess.run(
            [EAGLE3, "prepare"], cwd=tmp_path, capture_output=True, text=True, timeout=120
        )
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert done.returncode == 2
    assert done.stderr.startswith("error: prepare is already running (pid ")
    assert len(done.stderr.strip().splitlines()) == 1


def _leftovers(root: Path) -> dict[str, list[Path]]:
    """What killed runs of verifier, prepare and train leave (names as atomic.py makes them)."""
    made = {
        "verifier": [root / "data/.verifier.k2j4x9.tmp", root / "data/.verifier.old-4242"],
        "prepare": [
            root / "data/.prepared.a1b2c3.tmp",
            root / "metrics/provenance/.prepare.json.zz9.tmp",
        ],
        "train": [
            root / "models/.trained.q8.tmp",
            root / "metrics/.train.json.x1.tmp",
            root / "data/.work/train/checkpoints/3/.exact_state.pt.w2.tmp",
        ],
    }
    for files in made.values():
        for f in files:
            f.parent.mkdir(parents=True, exist_ok=True)
            if f.name.endswith("old-4242") or f.name.startswith(".verifier"):
                model_files(f, config={})
            else:
                f.write_text("x")
    return made


def test_sweep_removes_only_that_stages_temp_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    made = _leftovers(Path("."))
    keep = [Path("data/verifier/config.json"), Path("data/.work/extract/.s1.safetensors.9.tmp")]
    for f in keep:
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text("{}")
    assert sorted(stage_lock.sweep("verifier")) == sorted(made["verifier"])
    assert all(p.exists() for p in made["prepare"] + made["train"] + keep)
    assert sorted(stage_lock.sweep("train")) == sorted(made["train"])
    assert sorted(stage_lock.sweep("extract")) == []  # shards share it: extract sweeps itself
    assert all(p.exists() for p in made["prepare"] + keep)


def test_the_cli_sweeps_at_the_start_of_its_stage(tmp_path: Path) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"id": f"r{i}", "messages": [{"role": "user", "content": f"q{i}"}]}) + "\n"
            for i in range(6)
        )
    )
    (tmp_path / "params.yaml").write_text(
        yaml.safe_dump({"prepare": {"prompts": str(prompts), "val_ratio": 0.2}})
    )
    made = _leftovers(tmp_path)
    done = subprocess.run(
        [EAGLE3, "prepare"], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "[prepare] removed what a killed run left: 2 temp file(s)" in done.stdout
    assert not any(p.exists() for p in made["prepare"])
    assert all(p.exists() for p in made["verifier"] + made["train"])


def test_stage_outputs_match_dvc_yaml() -> None:
    stages = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    for name, stage in stages.items():
        if "foreach" in stage:  # family@NAME, curve_train@F...: the outputs of entry NAME
            body = stage["do"]
            key = "0.25" if "${item}" in str(body) else "peagle"
            outs = [o.replace("${key}", key).replace("${item}", key) for o in body.get("outs", [])]
            outs += [
                next(iter(m)).replace("${key}", key).replace("${item}", key)
                for m in body["metrics"]
            ]
            found = stage_lock.outputs_of(f"{name}@{key}")
            assert sorted(map(str, found)) == sorted(outs), name
            continue
        outs = [next(iter(o)) if isinstance(o, dict) else o for o in stage.get("outs", [])]
        outs += [next(iter(m)) if isinstance(m, dict) else m for m in stage.get("metrics", [])]
        outs += [next(iter(m)) if isinstance(m, dict) else m for m in stage.get("plots", [])]
        assert sorted(map(str, stage_lock.STAGE_OUTPUTS[name])) == sorted(outs), name
    assert stage_lock.LOCKS.parent == paths.SCRATCH


def test_lock_is_released_when_the_block_raises(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError), stage_lock.hold("vocab"):
        raise ValueError
    t0 = time.monotonic()
    with stage_lock.hold("vocab"):
        assert time.monotonic() - t0 < 1


def test_clean_work_is_refused_while_a_stage_runs_and_empties_scratch_after(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (paths.SCRATCH / "generate").mkdir(parents=True)
    (paths.SCRATCH / "generate/done.jsonl").write_text("{}\n")
    proc = _hold_in_child(tmp_path, "generate")
    try:
        run = subprocess.run([EAGLE3, "clean-work"], cwd=tmp_path, capture_output=True, text=True)
        assert run.returncode == 2 and "generate (pid " in run.stderr, run.stderr
        assert (paths.SCRATCH / "generate/done.jsonl").is_file()  # nothing deleted
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    run = subprocess.run([EAGLE3, "clean-work"], cwd=tmp_path, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert not (paths.SCRATCH / "generate").exists() and stage_lock.LOCKS.is_dir()
