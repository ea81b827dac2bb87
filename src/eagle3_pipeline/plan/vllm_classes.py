"""vLLM's model registry as the verifier checks ask it (is an architecture registered; which
class does an entry build, and does it implement `SupportsEagle3`), its answers kept on disk
against the files they came from, so that a rerun with the same vLLM imports no vLLM (~10 s on
2 cores).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import inspect
import json
import os
from pathlib import Path
from typing import Any

from eagle3_pipeline.core import atomic
from eagle3_pipeline.core.errors import ServerError
from eagle3_pipeline.plan.template import one_line


def _import_vllm() -> tuple[str, Any, Any]:
    """(version, ModelRegistry, supports_eagle3) of the installed vLLM."""
    import vllm

    try:
        from vllm import ModelRegistry  # the public entry point
    except ImportError:
        from vllm.model_executor.models.registry import ModelRegistry
    try:
        from vllm.model_executor.models.interfaces import supports_eagle3
    except ImportError:  # the interface's own flag, which SupportsEagle3 sets

        def supports_eagle3(cls: type) -> bool:
            return bool(getattr(cls, "supports_eagle3", False))

    try:  # out-of-tree models register themselves here, as every engine start does
        from vllm.plugins import load_general_plugins

        load_general_plugins()
    except Exception:
        pass
    return str(getattr(vllm, "__version__", "?")), ModelRegistry, supports_eagle3


def _load_class(registry: Any, arch: str) -> type:
    """The class of one registry entry, importing its one module (no engine, no subprocess):
    the entry's own loader (vLLM 0.32's lazy entries), else its module and class names, else
    the registry's loader."""
    entry = getattr(registry, "models", {}).get(arch)
    if entry is not None and hasattr(entry, "load_model_cls"):
        return entry.load_model_cls()
    if entry is not None and hasattr(entry, "module_name"):
        return getattr(importlib.import_module(entry.module_name), entry.class_name)
    cls = registry._try_load_model_cls(arch)
    if cls is None:
        raise ImportError(f"vLLM's registry could not load {arch}")
    return cls


def _stamp(files: list[str]) -> list[list[Any]]:
    """[path, size, mtime_ns] of each file; a missing file stamps as [path, -1, -1]."""
    out: list[list[Any]] = []
    for f in files:
        try:
            st = os.stat(f)
            out.append([f, st.st_size, st.st_mtime_ns])
        except OSError:
            out.append([f, -1, -1])
    return out


def _installed_stamp(vllm_dir: Path) -> dict[str, Any]:
    """What every cached answer depends on: vLLM's version, registry and interfaces files, and
    the plugins that may register models."""
    names = ["__init__.py", "version.py", "_version.py"]
    names += [f"model_executor/models/{n}" for n in ("registry.py", "interfaces.py")]
    try:
        plugins = sorted(
            e.value for e in importlib.metadata.entry_points(group="vllm.general_plugins")
        )
    except Exception:
        plugins = []
    return {
        "files": _stamp([str(vllm_dir / n) for n in names]),
        "plugins": plugins,
        "VLLM_PLUGINS": os.environ.get("VLLM_PLUGINS"),
    }


class VllmRegistry:
    """vLLM's model registry as far as the checks ask it, imported only when an answer is not
    cached yet (or a file it came from changed)."""

    def __init__(self, vllm_dir: Path, cache: Path | None) -> None:
        self.cache, self.changed = cache, False
        self._live: tuple[str, Any, Any] | None = None
        stamp = _installed_stamp(vllm_dir)
        data: dict[str, Any] = {}
        if cache is not None and cache.is_file():
            try:
                data = json.loads(cache.read_text())
            except ValueError:
                data = {}
        if not isinstance(data, dict) or data.get("installed") != stamp:
            data = {"installed": stamp, "known": {}, "classes": {}}
        self.data = data

    def _vllm(self) -> tuple[str, Any, Any]:
        if self._live is None:
            try:
                self._live = _import_vllm()
            except Exception as exc:
                raise ServerError(
                    f"vLLM is installed but does not import ({one_line(exc)}): reinstall it "
                    "(make venv)"
                ) from None
            self.changed |= self.data.get("version") != self._live[0]
            self.data["version"] = self._live[0]
        return self._live

    @property
    def version(self) -> str:
        return self.data.get("version") or self._vllm()[0]

    def known(self, arch: str) -> bool:
        if arch not in self.data["known"]:
            self.data["known"][arch] = arch in set(self._vllm()[1].get_supported_archs())
            self.changed = True
        return self.data["known"][arch]

    def implements(self, key: str) -> tuple[str, bool]:
        """(class name, implements SupportsEagle3) of a registry entry, loading its class."""
        entry = self.data["classes"].get(key)
        if entry is None or _stamp([f for f, *_ in entry["files"]]) != entry["files"]:
            _, registry, supports_eagle3 = self._vllm()
            cls = _load_class(registry, key)
            files = {inspect.getsourcefile(c) for c in cls.__mro__ if c.__module__[:5] == "vllm."}
            entry = {
                "name": cls.__name__,
                "eagle3": bool(supports_eagle3(cls)),
                "files": _stamp(sorted(f for f in files if f)),
            }
            self.data["classes"][key] = entry
            self.changed = True
        return entry["name"], entry["eagle3"]

    def save(self) -> None:
        if self.changed and self.cache is not None:
            with contextlib.suppress(OSError):  # read-only: the next run imports vLLM again
                atomic.write_json(self.cache, self.data)
