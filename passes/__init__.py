"""Rewrite passes, one per module, each a declared `GraphPass` (see fxspeed.pass_manager).

`default_pipeline()` is the order compile() runs them in:

    normalize_graph          drop detach/alias no-ops
    dedupe_tied_parameters   one input and one summed gradient per tied (shared) Parameter
    insert_casts             mixed precision: matmul/conv/attention in bf16/fp16, the rest fp32
    scale_loss               fp16: backward seeded with the dynamic loss scale (a graph input)
    eliminate_dead_code      drop values nothing reads (keeps random and mutating ops)
    reduce_gradients         bucketed async all-reduce / reduce-scatter of gradients (data parallel)
    wait_parameter_gathers   ZeRO-1/2: wait for each bucket's post-step all-gather at its first use
    shard_parameters         ZeRO-3: parameter shards as inputs, gathered before use, prefetched
    reuse_buffers            gathered / flattened buckets written into a few reused workspaces

The distributed passes read ctx.options (world_size, zero, group_name) and do nothing on one device.

Pipeline parallelism cuts the rewritten step into stage programs (`split_stages`, a function
of the graph, not a GraphPass: it returns P programs), then rewrites each rank's stages:

    accumulate_gradients     weight-gradient matmuls and embedding rows accumulate into persistent buffers

Their names are in STAGE_PASS_NAMES, so `Config.disable_passes` can turn them off too.
"""

from __future__ import annotations

from fxspeed.compiler.pass_manager import GraphPass

from .graph.dedupe_tied_parameters import dedupe_tied_parameters
from .graph.eliminate_dead_code import eliminate_dead_code
from .graph.insert_casts import insert_casts
from .graph.normalize_graph import normalize_graph
from .parallel.reduce_gradients import reduce_gradients
from .memory.reuse_buffers import reuse_buffers
from .graph.scale_loss import scale_loss
from .parallel.shard_parameters import shard_parameters
from .parallel.wait_parameter_gathers import wait_parameter_gathers

# DCE after the casts: it removes the fp32 views (W^T) that only low-precision ops used to read.
SINGLE_DEVICE_PASSES = (normalize_graph, dedupe_tied_parameters, insert_casts, scale_loss, eliminate_dead_code)
DISTRIBUTED_PASSES = (reduce_gradients, wait_parameter_gathers, shard_parameters, reuse_buffers)
ALL_PASSES: dict[str, GraphPass] = {p.name: p for p in (*SINGLE_DEVICE_PASSES, *DISTRIBUTED_PASSES)}
STAGE_PASS_NAMES = ("accumulate_gradients",)


def default_pipeline() -> list[GraphPass]:
    return [*SINGLE_DEVICE_PASSES, *DISTRIBUTED_PASSES]


__all__ = ["ALL_PASSES", "STAGE_PASS_NAMES", "DISTRIBUTED_PASSES", "SINGLE_DEVICE_PASSES", "insert_casts", "reduce_gradients", "reuse_buffers", "scale_loss",
           "shard_parameters", "wait_parameter_gathers", "dedupe_tied_parameters", "default_pipeline",
           "eliminate_dead_code", "normalize_graph"]
