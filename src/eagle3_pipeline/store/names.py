"""Sample ids -> store file names. Ids are data; file names are ours.

Real datasets carry ids such as `sharegpt/12345`, UUIDs with colons, spaces and non-ASCII text;
any of them must reach the store. An id that is already a safe name (lowercase ASCII letters,
digits, `.`, `_`, `-`, not starting with a dot or a dash, at most 128 characters: `p0001`,
`train-0001`) keeps it, so existing stores stay valid. Any other id gets
`<sanitized prefix>-<16 hex of its sha256>`. Either way: no control character, no hidden file,
no path separator, short enough for the writer's temp suffix (`.<name>.<pid>.tmp` < 255 bytes),
and all lowercase, so ids that differ only in case get different names even on a
case-insensitive filesystem. The manifest keeps the original id beside each file. No torch here:
prepare checks names without it.
"""

from __future__ import annotations

import hashlib
import re

from eagle3_pipeline.core.errors import DataError

SUFFIX = ".safetensors"
MAX_KEPT = 128  # longest id kept as its own file name
_KEPT = re.compile(rf"[a-z0-9_][a-z0-9._-]{{0,{MAX_KEPT - 1}}}")
_UNSAFE = re.compile(r"[^a-z0-9._-]+")
_PREFIX_CHARS = 48


def sample_filename(sample_id: str) -> str:
    """The store file of one sample (see the module docstring for the rule)."""
    if _KEPT.fullmatch(sample_id):
        return sample_id + SUFFIX
    prefix = _UNSAFE.sub("_", sample_id.lower()).lstrip("._-")[:_PREFIX_CHARS] or "id"
    digest = hashlib.sha256(sample_id.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    return f"{prefix}-{digest}{SUFFIX}"


def check_unique(ids: list[str], where: str) -> None:
    """Refuse two ids that would share a file (only a crafted id can: a kept name that equals
    another id's derived one, or a 64-bit hash collision)."""
    seen: dict[str, str] = {}
    for sid in ids:
        name = sample_filename(sid).casefold()
        if name in seen and seen[name] != sid:
            raise DataError(
                f"{where}: ids {seen[name]!r} and {sid!r} map to the same store file {name}: "
                "rename one of them"
            )
        seen[name] = sid
