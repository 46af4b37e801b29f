"""argparse value types shared by the CLI's subcommands: a bad value is argparse's one-line usage
error naming the flag, not a traceback from deep inside (Config, the serving loop) after the
model was built and compiled."""

from __future__ import annotations

import argparse
import json
from typing import Any, Callable


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
non_negative_int = _checked(int, lambda n: n >= 0, "an integer >= 0")


def key_value(text: str) -> tuple[str, Any]:
    """KEY=VALUE (`--set`, `--config`), the value read as JSON where it parses (numbers,
    true/false, null, lists), else kept as a string."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key.strip(), json.loads(value)
    except json.JSONDecodeError:
        return key.strip(), value
