"""Text helpers of `eagle3 plan`'s report: numbers and sizes as the team quotes them, rows."""

from __future__ import annotations


def millions(n: int) -> str:
    """Millions with one decimal, as the team quotes them; small counts exactly."""
    return f"{n / 1e6:,.1f}M" if n >= 10_000_000 else f"{n:,}"


def size(n: float) -> str:
    """Bytes in decimal units (disks are sold in them)."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{n:,.0f} B"


def row(label: str, text: str) -> str:
    return f"{label:<12}{text}"


def table(rows: list[list[str]], left: set[int]) -> list[str]:
    """Rows as aligned columns: the `left` ones left-aligned, numbers right-aligned."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [
        row(
            "",
            "  ".join(
                f"{cell:<{w}}" if i in left else f"{cell:>{w}}"
                for i, (cell, w) in enumerate(zip(r, widths, strict=True))
            ).rstrip(),
        )
        for r in rows
    ]
