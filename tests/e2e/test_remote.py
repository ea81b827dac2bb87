"""A teammate's run, pushed to a DVC remote and pulled into a fresh clone elsewhere: nothing reruns.

The teammate is the end-to-end run of tests/test_pipeline_e2e.py (shared per session, not rerun).
Remotes: an S3-compatible server (moto) on loopback with fake credentials from the environment,
and a local directory. The committed .dvc/config names the default remote `storage`; the tests
only override its url/endpoint in .dvc/config.local, as a teammate with their own bucket would.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from pipeline_repo import CURVE, FAMILIES, commit, tiny_pipeline

pytestmark = pytest.mark.slow
BUCKET = "eagle3-test"
STAGES = (
    *("check", "verifier", "synthesize", "prepare", "generate"),
    *("tokenize", "extract", "vocab", "train", "export"),
)
FAKE_SECRET = "fake-secret-never-in-a-file"


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "DVC_"))}
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
    env.update(DVC_NO_ANALYTICS="1", HF_HUB_OFFLINE="1", NO_PROXY="127.0.0.1,localhost")
    return env | (extra or {})


def _dvc(repo: Path, *args: str, env: dict[str, str] | None = None, ok: bool = True) -> str:
    proc = subprocess.run(
        ["dvc", *args], cwd=repo, env=env or _env(), capture_output=True, text=True
    )
    out = proc.stdout + proc.stderr
    if ok:
        assert proc.returncode == 0, f"dvc {' '.join(args)} failed:\n{out[-4000:]}"
    else:
        assert proc.returncode != 0, f"dvc {' '.join(args)} should have failed:\n{out[-4000:]}"
    return out


def lock_outs(repo: Path) -> dict[str, str]:
    """{output path: md5} of every stage in dvc.lock."""
    lock = yaml.safe_load((repo / "dvc.lock").read_text())
    return {
        out["path"]: out["md5"]
        for stage in lock["stages"].values()
        for out in stage.get("outs", [])
    }


def _clone(src: Path, dest: Path) -> Path:
    subprocess.run(["git", "clone", "-q", str(src), str(dest)], check=True, env=_env())
    return dest


def _assert_nothing_reruns(repo: Path, env: dict[str, str] | None = None) -> None:
    out = _dvc(repo, "repro", env=env)
    assert "Running stage" not in out, out
    for stage in (*STAGES, "evaluate"):
        assert f"Stage '{stage}' didn't change, skipping" in out, (stage, out)
    assert "Data and pipelines are up to date" in _dvc(repo, "status", env=env)


@pytest.fixture(scope="module")
def teammate(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The e2e run, committed with its dvc.lock, metrics and provenance records."""
    repo = tiny_pipeline(tmp_path_factory)
    commit(repo, "teammate's run")
    return repo


@pytest.fixture(scope="module")
def s3_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """moto's S3 server on loopback; credentials exist only in this environment."""
    import boto3
    from moto.server import ThreadedMotoServer

    aws_dir = tmp_path_factory.mktemp("aws")  # no user AWS config or profile can leak in
    (aws_dir / "config").write_text("")
    (aws_dir / "credentials").write_text("")
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    _, port = server.get_host_and_port()  # the kernel's pick at bind: no port to race for
    creds = {
        "AWS_ACCESS_KEY_ID": "fake-key-id",
        "AWS_SECRET_ACCESS_KEY": FAKE_SECRET,
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_CONFIG_FILE": str(aws_dir / "config"),
        "AWS_SHARED_CREDENTIALS_FILE": str(aws_dir / "credentials"),
    }
    endpoint = f"http://127.0.0.1:{port}"
    boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=creds["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=FAKE_SECRET,
        region_name="us-east-1",
    ).create_bucket(Bucket=BUCKET)
    try:
        yield _env(creds | {"ENDPOINT": endpoint})
    finally:
        server.stop()


def _point_storage_at_moto(repo: Path, env: dict[str, str]) -> None:
    """What a teammate with an S3-compatible store does once: url + endpoint, no secrets."""
    _dvc(repo, "remote", "modify", "--local", "storage", "url", f"s3://{BUCKET}/cache")
    _dvc(repo, "remote", "modify", "--local", "storage", "endpointurl", env["ENDPOINT"])


def test_committed_config_has_a_verifying_default_remote_and_no_secrets() -> None:
    from configobj import ConfigObj

    repo = Path(__file__).resolve().parents[2]
    cfg = ConfigObj(str(repo / ".dvc/config"))
    name = cfg["core"]["remote"]
    remote = cfg[f'remote "{name}"']
    assert remote["url"].startswith("s3://") and remote["verify"] == "true"
    assert not {"access_key_id", "secret_access_key", "session_token"} & set(remote)
    assert "/config.local" in (repo / ".dvc/.gitignore").read_text().split()


def test_s3_round_trip_nothing_reruns(
    teammate: Path, s3_env: dict[str, str], tmp_path: Path
) -> None:
    _point_storage_at_moto(teammate, s3_env)
    assert "files pushed" in _dvc(teammate, "push", env=s3_env)
    clone = _clone(teammate, tmp_path / "elsewhere" / "clone")
    _point_storage_at_moto(clone, s3_env)
    _dvc(clone, "pull", env=s3_env)
    _assert_nothing_reruns(clone, s3_env)
    assert lock_outs(clone) == lock_outs(teammate)
    assert (clone / "dvc.lock").read_bytes() == (teammate / "dvc.lock").read_bytes()
    for repo in (teammate, clone):  # credentials came from the environment only
        for cfg in (".dvc/config", ".dvc/config.local"):
            assert FAKE_SECRET not in (repo / cfg).read_text()
    # the provenance of the teammate's run travels with the commit
    shown = subprocess.run(
        ["eagle3", "provenance", "models/drafter/config.json"],
        cwd=clone,
        env=_env(),
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert '"stage": "export"' in shown


@pytest.fixture(scope="module")
def local_remote(teammate: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    remote = tmp_path_factory.mktemp("local-remote") / "store"
    _dvc(teammate, "remote", "add", "--local", "shared", str(remote))
    _dvc(teammate, "push", "-r", "shared")
    return remote


def _clone_on_local_remote(teammate: Path, remote: Path, dest: Path) -> Path:
    """A clone whose committed default remote `storage` (verify = true) is a local directory."""
    clone = _clone(teammate, dest)
    _dvc(clone, "remote", "modify", "--local", "storage", "url", str(remote))
    return clone


def _present(repo: Path) -> set[str]:
    """DVC-cached outputs in the workspace (`cache: false` metrics are in git: always there)."""
    in_git = set(
        subprocess.run(["git", "ls-files"], cwd=repo, capture_output=True, text=True).stdout.split()
    )
    return {p for p in lock_outs(repo) if p not in in_git and (repo / p).exists()}


def test_local_remote_round_trip_nothing_reruns(
    teammate: Path, local_remote: Path, tmp_path: Path
) -> None:
    clone = _clone_on_local_remote(teammate, local_remote, tmp_path / "clone")
    _dvc(clone, "pull")
    # 11 outputs of the main DAG; each families branch's and each curve fraction's drafter and
    # training curves
    branches = len(FAMILIES) + len(CURVE["fractions"])
    assert _present(clone) == _present(teammate) and len(_present(clone)) == 11 + 2 * branches
    assert {f"models/families/{name}" for name in FAMILIES} <= _present(clone)
    assert {f"models/curve/{f}" for f in CURVE["fractions"]} <= _present(clone)
    _assert_nothing_reruns(clone)
    assert (clone / "dvc.lock").read_bytes() == (teammate / "dvc.lock").read_bytes()


def test_partial_pulls(teammate: Path, local_remote: Path, tmp_path: Path) -> None:
    clone = _clone_on_local_remote(teammate, local_remote, tmp_path / "clone")
    # the exported drafter alone: what a server needs, without the hidden-state store
    _dvc(clone, "pull", "models/drafter")
    assert _present(clone) == {"models/drafter"}
    _dvc(clone, "pull", "export")  # the same, by stage name
    assert _present(clone) == {"models/drafter"}
    # `dvc pull train`: the stage's own outputs (checkpoints + training curves), not its inputs
    _dvc(clone, "pull", "train")
    assert _present(clone) == {"models/drafter", "models/trained", "metrics/train"}
    # --with-deps: also everything upstream, i.e. all training needs to rerun
    _dvc(clone, "pull", "--with-deps", "train")
    upstream = {
        "data/checked",
        "data/verifier",
        "data/synthesized",
        "data/prepared",
        "data/generated",
        "data/tokenized",
        "data/hidden_states",
        "data/vocab",
    }
    assert _present(clone) == upstream | {"models/drafter", "models/trained", "metrics/train"}
    out = _dvc(clone, "repro", "train")
    assert "Running stage" not in out and "Stage 'train' didn't change, skipping" in out


def _corrupt_drafter_config(remote: Path, teammate: Path, scratch: Path) -> tuple[Path, bytes]:
    """Replace the remote's object of models/drafter/config.json; (object path, original)."""
    lock = yaml.safe_load((teammate / "dvc.lock").read_text())
    tree = next(o for o in lock["stages"]["export"]["outs"] if o["path"] == "models/drafter")
    manifest = remote / "files/md5" / tree["md5"][:2] / tree["md5"][2:]
    entries = json.loads(manifest.read_text())
    cfg_md5 = next(e["md5"] for e in entries if e["relpath"] == "config.json")
    obj = remote / "files/md5" / cfg_md5[:2] / cfg_md5[2:]
    original = obj.read_bytes()
    (scratch / "corrupt").write_bytes(original.replace(b"eagle3", b"EAGLE3", 1))
    os.replace(scratch / "corrupt", obj)  # a new file: never write through a link into a cache
    return obj, original


def test_verify_rejects_a_corrupt_object_on_the_remote(
    teammate: Path, local_remote: Path, tmp_path: Path
) -> None:
    obj, original = _corrupt_drafter_config(local_remote, teammate, tmp_path)
    try:
        # without verify (DVC's default) the corrupt file lands in the workspace silently
        plain = _clone(teammate, tmp_path / "plain")
        _dvc(plain, "remote", "add", "--local", "--default", "plain", str(local_remote))
        _dvc(plain, "pull", "models/drafter")
        assert b"EAGLE3" in (plain / "models/drafter/config.json").read_bytes()
        # the committed remote verifies: the pull fails and the file never arrives
        clone = _clone_on_local_remote(teammate, local_remote, tmp_path / "clone")
        out = _dvc(clone, "pull", "models/drafter", ok=False)
        assert not (clone / "models/drafter/config.json").exists(), out
    finally:
        (tmp_path / "restored").write_bytes(original)
        os.replace(tmp_path / "restored", obj)
    shutil.rmtree(tmp_path / "clone")
