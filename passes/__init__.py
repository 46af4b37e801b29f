"""Rewrite passes, one per module, each a declared `GraphPass` (see fxspeed.pass_manager).

`default_pipeline()` is the order compile() runs them in.
"""

from __future__ import annotations

from fxspeed.pass_manager import GraphPass

from .eliminate_dead_code import eliminate_dead_code
from .normalize_graph import normalize_graph

ALL_PASSES: dict[str, GraphPass] = {p.name: p for p in (normalize_graph, eliminate_dead_code)}


def default_pipeline() -> list[GraphPass]:
    return [normalize_graph, eliminate_dead_code]


__all__ = ["ALL_PASSES", "default_pipeline", "eliminate_dead_code", "normalize_graph"]
