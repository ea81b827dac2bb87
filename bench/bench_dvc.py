"""Benchmark of DVC with a hidden-state store's shape (issue: "The hidden-state store at 800 GB
scale"): `dvc status` and no-op `dvc repro` with a 10,000-file store output in a temp git+dvc repo
(cache.type hardlink,symlink as .dvc/config), and whether the workspace file is the cache object.

Prints a table and writes bench/results/dvc.json. Runs in about a minute on 2 cores.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench/results/dvc.json"
VENV_BIN = Path(sys.executable).parent
DVC_FILES = 10_000


def _timed(fn, *args, **kw) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn(*args, **kw)
    return time.perf_counter() - t0, out


def bench_dvc(tmp: Path) -> dict:
    repo = tmp / "dvcrepo"
    repo.mkdir()
    env = os.environ | {
        "DVC_NO_ANALYTICS": "1",
        "DVC_SITE_CACHE_DIR": str(tmp / "dvc-site"),
        "PATH": f"{VENV_BIN}:{os.environ['PATH']}",
        "GIT_AUTHOR_NAME": "b",
        "GIT_AUTHOR_EMAIL": "b@b",
        "GIT_COMMITTER_NAME": "b",
        "GIT_COMMITTER_EMAIL": "b@b",
    }

    def sh(*cmd: str) -> float:
        t, done = _timed(subprocess.run, cmd, cwd=repo, env=env, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"{' '.join(cmd)}: {done.stdout}{done.stderr}")
        return t

    sh("git", "init", "-q")
    sh("dvc", "init", "-q")
    sh("dvc", "config", "cache.type", "hardlink,symlink")
    sh("dvc", "config", "core.checksum_jobs", "2")
    (repo / "make_store.py").write_text(
        "import os, sys\n"
        "os.makedirs('store', exist_ok=True)\n"
        f"for i in range({DVC_FILES}):\n"
        "    with open(f'store/s{i:05d}.safetensors', 'wb') as f:\n"
        "        f.write(os.urandom(4096))\n"
    )
    (repo / "dvc.yaml").write_text(
        yaml.safe_dump(
            {
                "stages": {
                    "store": {
                        "cmd": f"{sys.executable} make_store.py",
                        "deps": ["make_store.py"],
                        "outs": ["store"],
                    }
                }
            }
        )
    )
    first = sh("dvc", "repro", "-q")
    sh("git", "add", "-A")
    sh("git", "commit", "-qm", "store")
    status = [sh("dvc", "status", "-q") for _ in range(2)]
    noop = [sh("dvc", "repro", "-q") for _ in range(2)]
    ino = os.stat(next((repo / "store").iterdir())).st_nlink
    return {
        "files": DVC_FILES,
        "first_repro_s": first,
        "status_s": min(status),
        "noop_repro_s": min(noop),
        "status_runs_s": status,
        "noop_runs_s": noop,
        "workspace_file_links": ino,  # 2: the workspace file IS the cache object (no copy)
    }


def main() -> int:
    tmp = Path(tempfile.mkdtemp(prefix="bench-dvc-"))
    t0 = time.perf_counter()
    try:
        results = {"machine": f"{os.cpu_count()} CPUs", "disk_dir": str(tmp), "dvc": bench_dvc(tmp)}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    results["bench_s"] = time.perf_counter() - t0
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    print(render(results))
    print(f"-> {RESULTS.relative_to(REPO)}")
    return 0


def render(r: dict) -> str:
    dv = r["dvc"]
    status_label = f"dvc status, {dv['files']:,}-file store unchanged"
    lines = [
        f"{'measure':<52} {'value':>14}",
        f"{status_label:<52} {dv['status_s']:>12.2f} s",
        f"{'no-op dvc repro, same store':<52} {dv['noop_repro_s']:>12.2f} s",
        f"{'first dvc repro (write + hash + commit by hardlink)':<52} "
        f"{dv['first_repro_s']:>12.2f} s",
        f"bench took {r['bench_s']:.0f} s",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
