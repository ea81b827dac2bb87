"""Pipeline runs for end-to-end tests: a fresh git copy of the repo, shrunk params, `dvc repro`."""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from eagle3_pipeline.serving import server_process

REPO = Path(__file__).resolve().parents[2]

SMALL = {
    "verifier": {
        "tiny": {
            "train_steps": 150,  # a verifier whose answers carry a learnable signal
            "vocab_size": 1024,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
        }  # head_dim 32 for vLLM CPU
    },
    "prepare": {"max_prompts": 60, "val_ratio": 0.2},
    "generate": {"max_new_tokens": 32},
    # One paired speed-up round: on a machine running other tests beside it the figure is noise;
    # the rounds' order and median have their own tests (tests/unit/evaluation/test_speedup.py).
    "evaluate": {"max_eval_prompts": 6, "max_new_tokens": 24, "speedup_rounds": 1},
    "tokenize": {"max_seq_len": 128},
    "vocab": {"draft_vocab_size": 256},
    "train": {"epochs": 8, "max_tokens_per_batch": 512},
}


def merge(base: dict, over: dict) -> dict:
    """`base` with `over`'s leaves put in; an empty dict in `over` empties the section."""
    for k, v in over.items():
        base[k] = merge(base.get(k, {}), v) if isinstance(v, dict) and v else v
    return base


def repo_env(repo: Path | None = None, site: Path | None = None) -> dict[str, str]:
    """The venv's tools; stages import the code of the repo they run in, not the editable install
    (its files may change while a run takes minutes, and dvc.lock hashes the repo's own copy).
    `site`: a folder put first on PYTHONPATH (a sitecustomize.py that every process runs)."""
    env = dict(os.environ)
    # The machine's own thread counts: in-process speculators runs (unit tests) set these to 1
    # for the duration of a run, and a run started meanwhile would train on one thread (other
    # float sums, so other bytes than a run started at any other moment).
    for key in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env.pop(key, None)
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
    env.update(DVC_NO_ANALYTICS="1", HF_HUB_OFFLINE="1")
    if repo is not None and (repo / "src/eagle3_pipeline").is_dir():
        env["PYTHONPATH"] = str(repo / "src")
    if site is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))
    return env


def run_in(repo: Path, *cmd: str, site: Path | None = None) -> str:
    env = repo_env(repo, site)
    proc = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, f"{cmd} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout + proc.stderr


def make_repo(repo: Path, overrides: dict) -> Path:
    """A fresh git repo holding the project's tracked files, params shrunk by `overrides`."""
    files = subprocess.run(  # tracked and new (not ignored) files: the working tree's code
        ["git", "ls-files", "-co", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    for f in files:
        if not (REPO / f).is_file():
            continue  # deleted in the working tree, not yet committed
        (repo / f).parent.mkdir(parents=True, exist_ok=True)
        (repo / f).write_bytes((REPO / f).read_bytes())
    params = merge(yaml.safe_load((repo / "params.yaml").read_text()), overrides)
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    run_in(repo, "git", "init", "-q")
    commit(repo, "init")
    return repo


def commit(repo: Path, message: str) -> str:
    run_in(repo, "git", "add", "-A")
    who = ("-c", "user.name=t", "-c", "user.email=t@t")
    run_in(repo, "git", *who, "commit", "-qm", message, "--allow-empty")
    return run_in(repo, "git", "rev-parse", "HEAD").strip()


@dataclass(frozen=True)
class Run:
    """A pipeline run the session shares: a fresh copy of the repo with params shrunk by
    `overrides`, then `dvc repro [targets]`. `setup`: a command that makes what the params point
    at (a verifier folder) first; `site`: a folder first on every process's PYTHONPATH."""

    name: str
    overrides: dict
    targets: tuple[str, ...] = ()
    site: Path | None = None
    setup: tuple[str, ...] = ()
    # A run of the session whose finished repo (its DVC cache and dvc.lock) this one copies and
    # changes by `overrides`, committed: DVC then reruns only what the change touches.
    base: Run | None = None


def run_repo(tmp_path_factory: pytest.TempPathFactory, name: str) -> Path:
    """Where the session's run `name` lives: one folder per session, whoever runs it."""
    return tmp_path_factory.getbasetemp() / name / "repo"


def execute(
    tmp_path_factory: pytest.TempPathFactory,
    run: Run,
    started: Callable[[subprocess.Popen], None] = lambda proc: None,
) -> Path:
    """`run`, unless this session did it already (a marker written after a successful `dvc
    repro`); its repo. `started` is told of every process it starts."""
    repo = run_repo(tmp_path_factory, run.name)
    done = repo.parent / "repro-done"
    if done.is_file():
        return repo
    if repo.parent.exists():
        shutil.rmtree(repo.parent)
    # For iterating on the slow tests: EAGLE3_E2E_REUSE=<dir> copies a finished <dir>/<name>/
    # (a previous session's basetemp) instead of running the DAG again; the copy keeps its links.
    reuse = Path(os.environ.get("EAGLE3_E2E_REUSE", "/nonexistent")) / run.name
    if (reuse / "repro-done").is_file():
        subprocess.run(["cp", "-a", str(reuse), str(repo.parent)], check=True)
        return repo
    repo.parent.mkdir(parents=True)
    if run.base is None:
        repo.mkdir()
    log = repo.parent / "repro.log"
    steps = {"its setup": list(run.setup)} if run.setup else {}
    steps["dvc repro"] = ["dvc", "repro", *run.targets]
    with open(log, "w") as out:
        for what, cmd in steps.items():
            if what == "dvc repro" and run.base is not None:  # the base's repo, changed
                derive(session_run(tmp_path_factory, run.base), repo, run.overrides)
            elif what == "dvc repro":  # after the setup: the repo copy, then the DAG
                make_repo(repo, run.overrides)
            proc = subprocess.Popen(
                cmd,
                cwd=repo,
                env=repo_env(repo, run.site),
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own group: Lane.stop ends all of it
            )
            started(proc)
            code = proc.wait()
            assert code == 0, f"run {run.name}: {what} failed:\n{log.read_text()[-6000:]}"
    done.write_text("ok\n")
    return repo


def derive(base: Path, repo: Path, overrides: dict) -> Path:
    """A copy of the finished run at `base` (cache, outputs, dvc.lock), its params changed by
    `overrides` and committed, as a teammate would change a run."""
    subprocess.run(["cp", "-a", str(base), str(repo)], check=True)
    params = merge(yaml.safe_load((repo / "params.yaml").read_text()), overrides)
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    commit(repo, "derived run")
    return repo


class Lane:
    """Runs done one after another in a background thread, while the session's other tests run
    (tests/conftest.py starts it). A run is mostly single-threaded imports and vLLM start-ups: on
    2 cores it and the tests in the foreground each have one. One run at a time bounds memory
    (at most the two vLLM servers of `evaluate`)."""

    def __init__(self) -> None:
        self._queued: dict[str, threading.Event] = {}
        self._failed: dict[str, str] = {}
        self._proc: subprocess.Popen | None = None
        self._stopping = False
        self._thread: threading.Thread | None = None

    def start(self, tmp_path_factory: pytest.TempPathFactory, runs: list[Run]) -> None:
        self._queued = {run.name: threading.Event() for run in runs}
        atexit.register(self.stop)  # also when the session never reaches its own teardown
        self._thread = threading.Thread(
            target=self._work, args=(tmp_path_factory, runs), name="pipeline-runs", daemon=True
        )
        self._thread.start()

    def _work(self, tmp_path_factory: pytest.TempPathFactory, runs: list[Run]) -> None:
        for run in runs:
            try:
                if self._stopping:
                    raise RuntimeError("the session ended first")
                execute(tmp_path_factory, run, self._started)
            except BaseException as e:  # noqa: BLE001 - the test that waits for it reports it
                self._failed[run.name] = str(e)
            self._queued[run.name].set()

    def _started(self, proc: subprocess.Popen) -> None:
        self._proc = proc
        if self._stopping:  # stop() ran between the check and the start
            server_process.stop(proc, 0.0)

    def wait(self, name: str) -> bool:
        """Whether `name` is this lane's; if so, once it is done (its failure raised here)."""
        event = self._queued.get(name)
        if event is None:
            return False
        event.wait()
        if name in self._failed:
            raise AssertionError(f"pipeline run {name} failed: {self._failed[name]}")
        return True

    def stop(self, grace_s: float = 30.0) -> None:
        """End the run in progress, if any (a session that ends early) and start no other:
        SIGTERM to its process group (a stage then stops its vLLM servers), SIGKILL after
        `grace_s`."""
        self._stopping = True
        if self._proc is not None:
            server_process.stop(self._proc, grace_s)
        if self._thread is not None:
            self._thread.join()


LANE = Lane()


def session_run(tmp_path_factory: pytest.TempPathFactory, run: Run) -> Path:
    """The session's `run` (its repo): waited for when the background lane has it, done here
    otherwise. Module fixtures of different files share it (one folder per session)."""
    if LANE.wait(run.name):
        return run_repo(tmp_path_factory, run.name)
    return execute(tmp_path_factory, run)


# The families branches ride along (docs/families.md): mask token 1 is <|im_system|>, which the
# tiny tokenizer has and no row holds.
FAMILIES = {
    "eagle3_1": {"name": "eagle3.1"},
    "peagle": {"name": "peagle", "num_depths": 3, "mask_token_id": 1},
    "dflash": {"name": "dflash", "block_size": 4, "num_layers": 1, "mask_token_id": 1},
}
# DFlash reads its own layers (an early-to-late spread, as DFlash recipes do): the store holds
# the union with train's [2, 4, 5], and EAGLE-3 reads its three through the view.
DFLASH_LAYERS = [1, 3, 5, 7]
# No draft-count sweep here: its three more servers ran beside the other tests and cost CI ~9
# minutes; tests/unit/evaluation/test_draft_sweep.py covers it.
# The verifier writes a fifth of the prompts (Magpie, vLLM's engine), and the learning curve
# trains two nested fractions beside the full run (docs/learning-curve.md).
SYNTHESIZE = {"count": 12, "batch_size": 16, "max_prompt_tokens": 64, "max_samples_ratio": 10}
CURVE = {"fractions": [0.25, 0.5], "bootstrap_samples": 200}
TINY_RUN = Run(
    "e2e",
    SMALL
    | {
        "families": FAMILIES,
        "layers": {"family_aux_layer_ids": {"dflash": DFLASH_LAYERS}},
        "prepare": SMALL["prepare"] | {"synthesize": SYNTHESIZE, "synthesized_share": 0.2},
        "curve": CURVE,
    },
)


def tiny_pipeline(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shrunken default pipeline (vLLM backends, online evaluation) run by `dvc repro`."""
    return session_run(tmp_path_factory, TINY_RUN)


# Online mode (tests/e2e/test_online_e2e.py): the run above with only train.hidden_states
# changed, committed and reproduced by DVC, in the lane right after it.
ONLINE_RUN = Run(
    "online",
    {
        "train": {"hidden_states": "online"},
        "families": {},  # the store run's branches: not what this mode is about
        "layers": {"family_aux_layer_ids": {}},  # nor their layers
        "curve": {"fractions": []},  # the curve trains on a store this mode does not write
        # Served evaluation is the store run's (the drafter's format and export are the same
        # code); offline evaluation compares what the two modes learned.
        "evaluate": {"online": False},
    },
    base=TINY_RUN,
)


def online_pipeline(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny pipeline's run switched to online mode (ONLINE_RUN); its `dvc repro` output is
    `repro_log(repo)`."""
    return session_run(tmp_path_factory, ONLINE_RUN)


def repro_log(repo: Path) -> str:
    """What the session run's `dvc repro` printed (stdout and stderr)."""
    return (repo.parent / "repro.log").read_text()
