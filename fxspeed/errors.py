"""Exceptions raised by fxspeed. Each names what the user controls (module, node, config key)."""

from __future__ import annotations

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
