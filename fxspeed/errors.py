"""Exceptions raised by fxspeed. Each names what the user controls (module, node, config key)."""

from __future__ import annotations

import sys
import warnings
from typing import Any


class FxspeedError(Exception):
    """Base class of every error fxspeed raises on purpose."""


class CaptureError(FxspeedError):
    """The model's training step could not be traced into one FX graph.

    The message names the failing op and the user's source line, and says how to fix it.
    """

    def __init__(self, message: str, *, op: str | None = None, source: str | None = None):
        super().__init__(message)
        self.op = op
        self.source = source


class ConfigError(FxspeedError, ValueError):
    """A `Config` field or a `devices` value is invalid. Subclasses ValueError."""


class PassError(FxspeedError):
    """A rewrite pass failed or left an invalid graph; names the pass and those run before it."""


def short_repr(value: Any, limit: int = 120) -> str:
    """`repr(value)` cut to `limit` characters, for a value quoted inside an error message."""
    r = repr(value)
    return r if len(r) <= limit else r[:limit - 3] + "..."


def warn_user(message: str, category: type[Warning] = UserWarning) -> None:
    """`warnings.warn` attributed to the first frame outside fxspeed: the user's line (their
    `fxspeed.compile(...)` or `Config(...)` call), however deep in the compiler the warning is
    raised. A fixed stacklevel pointed into fxspeed's own files whenever the call path changed,
    and Python 3.11's `warnings.warn` has no `skip_file_prefixes`. Frames of torch and contextlib
    between fxspeed's own (a TorchFunctionMode, a `with` block) are skipped with them."""
    frame, level = sys._getframe(1), 1
    while frame is not None and _internal(frame):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level + 1)


_PASSED_THROUGH = ("torch", "contextlib", "functools")


def _package(frame: Any) -> str:
    return frame.f_globals.get("__name__", "").split(".")[0]


def _internal(frame: Any) -> bool:
    if _package(frame) == "fxspeed":
        return True
    if _package(frame) not in _PASSED_THROUGH:
        return False
    # torch's or contextlib's frames only while fxspeed called them: a user frame between ends the walk
    outer = frame.f_back
    while outer is not None and _package(outer) in _PASSED_THROUGH:
        outer = outer.f_back
    return outer is not None and _package(outer) == "fxspeed"
