"""Rewrite passes, one per module, each a declared `GraphPass` (see fxspeed.pass_manager).

`default_pipeline()` is the order compile() runs them in:

    normalize_graph          drop detach/alias no-ops
    dedupe_tied_parameters   one input and one summed gradient per tied (shared) Parameter
    eliminate_dead_code      drop values nothing reads (keeps random and mutating ops)
"""

from __future__ import annotations

from fxspeed.pass_manager import GraphPass

from .dedupe_tied_parameters import dedupe_tied_parameters
from .eliminate_dead_code import eliminate_dead_code
from .normalize_graph import normalize_graph

ALL_PASSES: dict[str, GraphPass] = {p.name: p for p in (normalize_graph, dedupe_tied_parameters, eliminate_dead_code)}


def default_pipeline() -> list[GraphPass]:
    return [normalize_graph, dedupe_tied_parameters, eliminate_dead_code]


__all__ = ["ALL_PASSES", "dedupe_tied_parameters", "default_pipeline", "eliminate_dead_code", "normalize_graph"]
