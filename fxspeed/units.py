"""Byte counts as people read them, in the unit that keeps the figure readable: a small
model's plan printed "0.000 GB" for its parameters, and a small test disk's error "0.00 GB"."""

from __future__ import annotations


def size(nbytes: float, width: int = 0) -> str:
    """`size(3.2e9)` -> "3.20 GB", `size(271_000)` -> "271.00 kB", `size(12)` -> "12 bytes";
    right-aligned to `width` characters (columns of a summary)."""
    text = f"{int(nbytes)} bytes"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(nbytes) >= scale:
            text = f"{nbytes / scale:.2f} {unit}"
            break
    return text.rjust(width)
