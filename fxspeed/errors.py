"""Exceptions raised by fxspeed. Each names what the user controls (module, node, config key)."""

from __future__ import annotations


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
