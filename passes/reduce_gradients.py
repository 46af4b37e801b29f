"""reduce_gradients: average gradients across data-parallel ranks in buckets, as backward
produces them, with asynchronous collectives; each wait sits right after the next bucket is issued.

    before:  ... g_w2 = mm(...) ... g_w1 = mm(...) ...      return (loss, g_w2, g_w1)
    after:   ... g_w2 = mm(...)
                 b0 = all_reduce(pad(cat(g_w2 / N, ...)))      # issued here, runs in the
             ... g_w1 = mm(...)                                # background while backward
                 b1 = all_reduce(pad(cat(g_w1 / N, ...)))      # goes on
                 w0 = wait(b0)                                 # one bucket in flight
             w1 = wait(b1)                                     return (loss, w0, w1)

ZeRO-0/1 all-reduce (each rank gets the whole averaged bucket); ZeRO-2/3 reduce-scatter (each
rank gets only its shard and the full gradients die right after the collective is issued).
Buckets hold parameters in the order their gradients are completed, up to `bucket_bytes`,
and are padded to a multiple of the world size. The layout goes to `signature.buckets`;
outputs become "grad_bucket" entries.

Options read from ctx.options: world_size, zero, group_name, bucket_bytes.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from fxspeed.ir import Bucket, IOSpec, dtype_name
from fxspeed.pass_manager import PassContext, PassResult, graph_pass
from fxspeed.rewrite import call, output_node

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

DEFAULT_BUCKET_BYTES = 25 * 2**20


@graph_pass("reduce_gradients", produces=("gradient_buckets",), invalidates=("annotate",))
def reduce_gradients(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    world = int(ctx.options.get("world_size", 1))
    if world == 1:
        return PassResult(gm, modified=False)
    zero = int(ctx.options.get("zero", 0))
    group = ctx.options["group_name"]
    limit = int(ctx.options.get("bucket_bytes", DEFAULT_BUCKET_BYTES))
    sig = ctx.signature
    out = output_node(gm)
    outs = list(out.args[0])
    order = {n: i for i, n in enumerate(gm.graph.nodes)}

    grads = sorted((order[outs[i]], i) for i, s in enumerate(sig.outputs) if s.kind == "grad")
    groups: list[list[int]] = []
    size = limit
    for _, i in grads:
        val = outs[i].meta["val"]
        if size >= limit or dtype_name(val.dtype) != dtype_name(outs[groups[-1][-1]].meta["val"].dtype):
            groups.append([])
            size = 0
        groups[-1].append(i)
        size += val.numel() * val.element_size()

    waits: list[fx.Node] = []
    buckets: list[Bucket] = []
    pending: fx.Node | None = None
    for k, members in enumerate(groups):
        nodes = [outs[i] for i in members]
        shapes = [tuple(int(d) for d in n.meta["val"].shape) for n in nodes]
        numels = [n.meta["val"].numel() for n in nodes]
        offsets = [sum(numels[:j]) for j in range(len(numels))]
        total = sum(numels)
        padded = -(-total // world) * world
        buckets.append(Bucket(k, [sig.outputs[i].target for i in members], shapes, offsets, total, padded,
                              dtype_name(nodes[0].meta["val"].dtype)))
        last = max(nodes, key=order.__getitem__)
        g = gm.graph
        with g.inserting_before(last.next):  # keeps the new nodes in creation order
            flats = []
            for n in nodes:
                flats.append(call(g, aten.reshape.default, (n, [-1])))
            flat = call(g, aten.cat.default, (flats,)) if len(flats) > 1 else flats[0]
            if padded != total:
                flat = call(g, aten.constant_pad_nd.default, (flat, [0, padded - total]))
            # Pre-divide so the sum over ranks is the mean: the gradient of the global batch.
            scaled = call(g, aten.mul.Tensor, (flat, 1.0 / world))
            if zero >= 2:
                coll = call(g, c10d.reduce_scatter_tensor.default, (scaled, "sum", world, group))
            else:
                coll = call(g, c10d.all_reduce.default, (scaled, "sum", group))
        # Wait for the previous bucket right after this one is issued: one bucket stays in
        # flight behind backward, and a finished collective releases its (full-size) input.
        if pending is not None:
            with g.inserting_after(coll):
                waits.append(call(g, c10d.wait_tensor.default, (pending,)))
        pending = coll
    if pending is not None:
        with g.inserting_before(out):
            waits.append(call(g, c10d.wait_tensor.default, (pending,)))

    keep = [i for i, s in enumerate(sig.outputs) if s.kind != "grad"]
    out.args = (tuple([outs[i] for i in keep] + waits),)
    sig.outputs = [sig.outputs[i] for i in keep] + [IOSpec("grad_bucket", str(b.index)) for b in buckets]
    sig.buckets = buckets
    return PassResult(gm, modified=True)
