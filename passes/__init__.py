"""Rewrite passes, one per module, each a declared `GraphPass` (see fxspeed.pass_manager).

`default_pipeline()` is the order compile() runs them in:

    normalize_graph          drop detach/alias no-ops
    dedupe_tied_parameters   one input and one summed gradient per tied (shared) Parameter
    eliminate_dead_code      drop values nothing reads (keeps random and mutating ops)
    reduce_gradients         bucketed async all-reduce / reduce-scatter of gradients (data parallel)
    shard_parameters         ZeRO-3: parameter shards as inputs, gathered before use, prefetched

The last two read ctx.options (world_size, zero, group_name) and do nothing on one device.
"""

from __future__ import annotations

from fxspeed.pass_manager import GraphPass

from .dedupe_tied_parameters import dedupe_tied_parameters
from .eliminate_dead_code import eliminate_dead_code
from .normalize_graph import normalize_graph
from .reduce_gradients import reduce_gradients
from .shard_parameters import shard_parameters

SINGLE_DEVICE_PASSES = (normalize_graph, dedupe_tied_parameters, eliminate_dead_code)
DISTRIBUTED_PASSES = (reduce_gradients, shard_parameters)
ALL_PASSES: dict[str, GraphPass] = {p.name: p for p in (*SINGLE_DEVICE_PASSES, *DISTRIBUTED_PASSES)}


def default_pipeline() -> list[GraphPass]:
    return [*SINGLE_DEVICE_PASSES, *DISTRIBUTED_PASSES]


__all__ = ["ALL_PASSES", "DISTRIBUTED_PASSES", "SINGLE_DEVICE_PASSES", "reduce_gradients", "shard_parameters", "dedupe_tied_parameters", "default_pipeline", "eliminate_dead_code", "normalize_graph"]
