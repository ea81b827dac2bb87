"""Where a sample falls, by a hash of its id alone: val or train, and which training fractions.

The position depends only on the id (not on file order or the number of samples), so adding
samples never moves one between train and val, and the learning curve's fractions are nested:
a training row inside fraction f is inside every larger one.
"""

from __future__ import annotations

import hashlib


def position(sample_id: str) -> float:
    """The id's hash read as a fraction in [0, 1)."""
    digest = hashlib.sha256(sample_id.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def is_val(sample_id: str, val_ratio: float) -> bool:
    return position(sample_id) < val_ratio


def in_fraction(sample_id: str, fraction: float, val_ratio: float) -> bool:
    """A training row (position >= val_ratio) inside the first `fraction` of the training
    positions: the training rows spread evenly over [val_ratio, 1)."""
    return (position(sample_id) - val_ratio) / (1.0 - val_ratio) < fraction
