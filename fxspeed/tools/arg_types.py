"""argparse value types shared by the CLI's subcommands: a bad value is argparse's one-line usage
error naming the flag, not a traceback from deep inside (Config, the serving loop) after the
model was built and compiled."""

from __future__ import annotations

import argparse
from typing import Callable


def _checked(convert: Callable[[str], float], ok: Callable[[float], bool], expected: str) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if not ok(value):  # NaN fails every comparison: refused too
            raise argparse.ArgumentTypeError(f"expected {expected}, got {value:g}")
        return value

    return parse


positive_int = _checked(int, lambda n: n >= 1, "a positive integer")
probability = _checked(float, lambda p: 0.0 < p <= 1.0, "a number in (0, 1]")  # a top-p
non_negative_float = _checked(float, lambda x: x >= 0.0, "a number >= 0")
