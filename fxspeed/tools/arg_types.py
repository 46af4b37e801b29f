"""argparse value types shared by the CLI's subcommands: a bad value is argparse's one-line usage
error naming the flag, not a traceback from deep inside (Config, the serving loop) after the
model was built and compiled."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {n}")
    return n


def probability(text: str) -> float:
    """A top-p: a float in (0, 1]."""
    try:
        p = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}") from None
    if not 0.0 < p <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {p:g}")
    return p


def non_negative_float(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from None
    if not x >= 0.0:  # NaN too
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {x:g}")
    return x
