"""The output a stage published last time, as DVC restores it: where a stage whose inputs grew
finds the rows it made already.

The stages whose data grows by rows (synthesize, generate, tokenize, extract) key each row by its
own inputs and the settings that make it (core/resume.py `row_key`), write the key into the
output they publish, and at their next start reuse every row whose key they find there.

DVC deletes a stage's outputs before it runs the stage. `persist: true` would keep them, but
with the project's hardlink cache DVC then copies every persisted file before the stage runs
(the whole hidden-state store) and leaves the stage out of its run-cache (docs/store.md). The
cache keeps them anyway: dvc.lock names each output's directory object (`<md5>.dir`, the list of
its files' objects), so a stage reads the output dvc.lock records straight from the cache,
whoever put it there: the last `dvc repro`, or `dvc pull` of a teammate's outputs. An output
still in the workspace (the stage run as `eagle3 <stage>`, outside DVC) is the newest: it is
read instead.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import yaml

from eagle3_pipeline.core import atomic, readers

DVC_LOCK = Path("dvc.lock")


@dataclass(frozen=True)
class Published:
    """One published output: its files by path inside the output folder."""

    where: str  # for the log: the folder, or the folder as dvc.lock records it in the cache
    root: Path | None = None  # the output in the workspace
    objects: dict[str, Path] | None = None  # else: path inside the output -> cache object
    link: bool = True  # whether its files may be hardlinked into a new output

    def file(self, rel: str) -> Path | None:
        """The file `rel` of this output (None when it has none, or its object is gone)."""
        path = self.root / rel if self.root is not None else (self.objects or {}).get(rel)
        return path if path is not None and path.is_file() else None

    def put(self, rel: str, dst: Path) -> None:
        """Place the file `rel` at `dst` (a new name in an output being written): a hardlink
        where the cache links its files anyway, else a copy (an object of a copy cache must
        never share an inode with a workspace file)."""
        src = self.file(rel)
        if src is None:
            raise FileNotFoundError(f"{self.where}: {rel} not found")
        atomic.link_or_copy(src, dst, link=self.link)


def previous(out: Path, lock: Path = DVC_LOCK) -> Published | None:
    """The output `out` (a folder) as last published: the workspace's, else the one dvc.lock
    records, read from the DVC cache; None when there is neither (a first run, or an output
    never pulled into this cache)."""
    if out.is_dir():
        return Published(str(out), root=out)
    md5 = locked_dir_md5(out, lock)
    root = lock.resolve().parent
    if md5 is None or not (root / ".dvc").is_dir():
        return None
    from dvc.exceptions import DvcException
    from dvc.repo import Repo  # a second's import, only where there is something to read

    try:
        repo = Repo(str(root))
    except DvcException:  # not a project DVC can open: nothing to read, every row is made
        return None
    try:
        cache = repo.cache.local
        listing = Path(cache.oid_to_path(md5))
        if not listing.is_file():
            return None
        objects = {
            e["relpath"]: Path(cache.oid_to_path(e["md5"])) for e in json.loads(listing.read_text())
        }
        link = "hardlink" in (cache.cache_types or [])
    finally:
        repo.close()
    return Published(
        f"{out} as dvc.lock records it ({md5[:8]}, DVC cache)", objects=objects, link=link
    )


def keyed_rows(out: Path, names: tuple[str, ...]) -> tuple[dict[str, dict], str | None]:
    """The rows of the JSONL files `names` of the output `out` as last published, by their
    `row_key` (rows without one are never reused), and where they were read (None: nowhere)."""
    prev = previous(out)
    if prev is None:
        return {}, None
    rows: dict[str, dict] = {}
    for name in names:
        path = prev.file(name)
        for r in readers.read_jsonl(path) if path else []:
            if "row_key" in r:
                rows[r["row_key"]] = r
    return rows, prev.where


def locked_dir_md5(out: Path, lock: Path = DVC_LOCK) -> str | None:
    """The directory object (`<md5>.dir`) dvc.lock records for the output folder `out`."""
    if not lock.is_file():
        return None
    stages = (yaml.safe_load(lock.read_text()) or {}).get("stages") or {}
    for stage in stages.values():
        for o in stage.get("outs") or []:
            if Path(o.get("path", "")) == out and str(o.get("md5", "")).endswith(".dir"):
                return o["md5"]
    return None


def reuse_line(total: int, making: int, where: str | None, reused: int, journaled: int = 0) -> str:
    """The one line each growing stage logs: `reused N of M rows from <output>; making K`.
    `journaled`: rows the published output lacks that the scratch journal held (a killed run)."""
    sources = [f"{where} ({reused})" if journaled else where] if where and reused else []
    if journaled:
        sources.append(f"the scratch journal ({journaled})")
    source = " and ".join(s for s in sources if s) or where or "no earlier output"
    return f"reused {reused + journaled} of {total} rows from {source}; making {making}"
