"""Environment variables set for a while and put back as they were.

vLLM's in-process engines need variables only while they start, and speculators' loader
builder sets thread limits in its caller: either, left behind, would reach every process this
one starts later (servers in tests, training's own workers).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator, Mapping


@contextlib.contextmanager
def restored(keys: Iterable[str] = (), set_to: Mapping[str, str] | None = None) -> Iterator[None]:
    """Inside: `set_to` set; after: `keys` and `set_to`'s keys as they were (unset ones unset)."""
    wanted = dict(set_to or {})
    before = {k: os.environ.get(k) for k in {*keys, *wanted}}
    os.environ.update(wanted)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
