"""reduce_gradients: average gradients across data-parallel ranks in buckets, as backward
produces them, with asynchronous collectives; each wait sits just before the next bucket is flattened.

    before:  ... g_w2 = mm(...) ... g_w1 = mm(...) ...      return (loss, g_w2, g_w1)
    after:   ... g_w2 = mm(...)
                 b0 = all_reduce(pad(cat(g_w2, ...)))          # issued here, runs in the
             ... g_w1 = mm(...)                                # background while backward
                 w0 = wait(b0)                                 # goes on; one bucket in flight
                 b1 = all_reduce(pad(cat(g_w1, ...)))          # (the 1/N is in backward's seed)
             w1 = wait(b1)                                     return (loss, w0, w1)

ZeRO-0/1 all-reduce (each rank gets the whole averaged bucket); ZeRO-2/3 reduce-scatter (each
rank gets only its shard and the full gradients die right after the collective is issued).
With `scatter_via_all_reduce` (an option the engine no longer sets: `scatter_via_exchange`
below replaced it on gloo; benchmarks/count_collective_bytes.py still measures it) ZeRO-2/3
instead all-reduce the fresh flat buffer in place and keep a copy of this rank's slice right
after the wait:

    before:  b0 = reduce_scatter(flat0) ...               w0 = wait(b0)
    after:   b0 = all_reduce_(flat0)    ...               w0 = clone(slice(wait(b0), rank*s, (rank+1)*s))

Memory is the same: the full flat buffer lives until the wait either way.

With `scatter_via_exchange` (the engine sets it on gloo, where it takes precedence) ZeRO-2/3
reduce-scatter with point-to-point transfers (runtime/kernels/collectives.py): each rank
sends every peer that peer's chunk of the flat bucket and adds what it receives to its own
chunk after the wait, half an all-reduce's bytes:

    before:  b0 = all_reduce_(flat0)                 ...  w0 = clone(slice(wait(b0), rank*s, (rank+1)*s))
    after:   b0 = fxspeed.exchange_scatter(flat0)    ...  w0 = add_(wait(b0), slice(flat0, rank*s, (rank+1)*s))

(with more than 2 ranks the received (N-1) chunks are summed first, into a new shard). ZeRO-1
keeps its all-reduce: it holds the full reduced gradients by definition (see the decision).
why: docs/decisions/zero-scatter-via-all-reduce-on-gloo.md

With `reuse_grad_buckets` (ZeRO-0, which keeps every reduced bucket until the optimizer step
as the Parameters' gradients) each bucket is flattened into a persistent buffer that the runtime owns and binds as a
"grad_buffer" graph input, as DDP reuses its buckets, instead of into a fresh tensor each step:

    before:  b0 = all_reduce_(cat([g_w2, ...]))                     # new 25 MB tensor per step
    after:   b0 = all_reduce_(cat.out([g_w2, ...], out=grad_buffer_0))

Needs the gradients in their own dtype and the 1/N in the backward seed; otherwise a bucket
gets a fresh buffer. ZeRO-1/2/3 keep fresh flat buffers (reuse_buffers places them).
why: docs/decisions/persistent-gradient-buckets-for-zero0.md

Gradient accumulation (`grad_accum_role`, ZeRO-0/1 under Config.grad_accum, DDP's no_sync):
the step's first slices run "local" programs, which flatten (and scale) each bucket and reduce
nothing; the last slice's program takes the sum of their flat buckets as "grad_accum" inputs and
adds it before the one reduction of the step, which still overlaps that slice's backward:

    local:  b0 = mul(cat([g_w2, ...]), 1/N)                                      return (loss, b0, ...)
    last:   b0 = all_reduce_(add(mul(cat([g_w2, ...]), 1/N), grad_accum_0))     ...

so a step of k slices moves one slice's bytes, not k times them. (ZeRO-2/3 keep reducing every
slice, as DeepSpeed does: their point is to hold only the shard of each gradient.)

On one rank (world_size 1) nothing is reduced and the pass returns the graph unchanged, except
under master weights with optimizer or parameter offload (`master_weights` on one rank), where the runtime's
flat layout needs the buckets: each bucket is flattened (cat + pad), no collective.

Buckets hold parameters in the order their gradients are completed, up to `bucket_bytes`,
and are padded to a multiple of the world size; with `bucket_layout` (the engine's flat buffers,
laid out from its first program) a later program's buckets are those, in that order. The mean
over ranks comes from seeding backward with 1/N (fxspeed.compiler.rewrite.scale_backward_seed),
so no extra pass over the gradients is needed. The layout goes to `signature.buckets`; outputs become "grad_bucket" entries.

Options read from ctx.options: world_size, rank, zero, group_name, bucket_bytes, bucket_layout,
scatter_via_all_reduce, scatter_via_exchange, reuse_grad_buckets, grad_accum_role, reduce_dtype
("auto" default, and "fp32": gradients are reduced in their own dtype, which keep_weights_low
made the working precision under master weights; "bf16"/"fp16" halve the bytes of fp32 ones).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from fxspeed.ir import Bucket, IOSpec, dtype_name
from fxspeed.compiler.pass_manager import PassContext, PassResult, graph_pass
from fxspeed.compiler.rewrite import call, output_node, scale_backward_seed
from fxspeed.runtime.kernels.collectives import exchange_scatter

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

REDUCE_DTYPES = {"auto": None, "fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}  # None: the gradient's own


@graph_pass("reduce_gradients", produces=("gradient_buckets",), invalidates=("annotate",))
def reduce_gradients(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    opts = ctx.options
    world = opts.world_size
    local = world == 1
    if local and not opts.master_weights:
        return PassResult(gm, modified=False)
    zero = opts.zero
    group = opts.dp_group("reduce_gradients") if not local else ""
    limit = opts.bucket_bytes
    reduce_dtype = REDUCE_DTYPES[opts.reduce_dtype]
    # Only ZeRO-0/1 over several replicas accumulate slices locally (ZeRO-2/3 scatter every slice).
    role = "whole" if local or zero >= 2 else opts.grad_accum_role
    # ZeRO-1 keeps all-reducing: its layout holds the full reduced gradients (the ZeRO paper's
    # P_os, what the planner counts); a reduce-scatter would give it ZeRO-2's gradient memory.
    # (one replica has nothing to scatter: its "reduced" buckets are the flattened gradients)
    via_exchange = not local and zero >= 2 and opts.scatter_via_exchange
    via_all_reduce = not local and zero >= 2 and opts.scatter_via_all_reduce and not via_exchange
    rank = opts.rank
    sig = ctx.signature
    out = output_node(gm)
    outs = list(out.args[0])
    order = {n: i for i, n in enumerate(gm.graph.nodes)}

    grads = sorted((order[outs[i]], i) for i, s in enumerate(sig.outputs) if s.kind == "grad")

    def kind(i: int) -> str:
        return dtype_name(outs[i].meta["val"].dtype)

    groups: list[list[int]] = []
    size = limit
    by_target = {sig.outputs[i].target: i for _, i in grads}
    if opts.bucket_layout and sorted(n for b in opts.bucket_layout for n in b) == sorted(by_target):
        # The engine's flat buffers hold these buckets (its first program's): this trace may
        # complete the gradients in another order (a tp layout solved for another batch shape).
        # Another set of gradients (forward took another branch) is bucketed afresh below, and
        # the engine names what changed.
        groups = [[by_target[n] for n in names] for names in opts.bucket_layout]
    else:
        for _, i in grads:
            val = outs[i].meta["val"]
            if size >= limit or kind(i) != kind(groups[-1][-1]):
                groups.append([])
                size = 0
            groups[-1].append(i)
            size += val.numel() * val.element_size()

    scale = 1.0 if local or scale_backward_seed(gm, sig, 1.0 / world) else 1.0 / world
    # Persistent buffers only where nothing but the flattening writes the reduced bucket.
    reuse = opts.reuse_grad_buckets and zero == 0 and scale == 1.0 and role != "local"
    last_input = [n for n in gm.graph.nodes if n.op == "placeholder"][-1]
    buffers: list[int] = []
    added: list[IOSpec] = []  # the new inputs, in placeholder order
    waits: list[fx.Node] = []
    buckets: list[Bucket] = []
    pending: fx.Node | None = None
    # Where the previous bucket's nodes end, and the graph position of the latest gradient so far:
    # a bucket whose gradients are all done before an earlier bucket's (a given layout) is
    # flattened after that bucket's collective, so that the buckets stay issued in order.
    stop: fx.Node | None = None
    frontier = -1
    for k, members in enumerate(groups):
        tail = stop.prev if stop is not None else None  # the last node made for the previous bucket
        nodes = [outs[i] for i in members]
        shapes = [tuple(int(d) for d in n.meta["val"].shape) for n in nodes]
        numels = [n.meta["val"].numel() for n in nodes]
        offsets = [sum(numels[:j]) for j in range(len(numels))]
        total = sum(numels)
        padded = -(-total // world) * world
        buckets.append(Bucket(k, [sig.outputs[i].target for i in members], shapes, offsets, total, padded,
                              dtype_name(nodes[0].meta["val"].dtype)))
        last = max(nodes, key=order.__getitem__)
        anchor = last if order[last] > frontier or tail is None else tail
        frontier = max(frontier, order[last])
        g = gm.graph
        buf: fx.Node | None = None
        if reuse and (reduce_dtype is None or reduce_dtype == nodes[0].meta["val"].dtype):
            with g.inserting_after(last_input):  # inputs stay in signature order: after the others
                buf = last_input = g.placeholder(f"grad_buffer_{k}")
            buf.meta["val"] = nodes[0].meta["val"].new_empty(padded)
            buffers.append(k)
            added.append(IOSpec("grad_buffer", str(k)))
        acc: fx.Node | None = None
        if role == "last":  # the earlier slices' flat bucket, in the gradients' dtype
            with g.inserting_after(last_input):
                acc = last_input = g.placeholder(f"grad_accum_{k}")
            acc.meta["val"] = nodes[0].meta["val"].new_empty(padded)
            added.append(IOSpec("grad_accum", str(k)))
        stop = anchor.next
        with g.inserting_before(stop):  # keeps the new nodes in creation order
            # Wait for the previous bucket just before flattening this one: its collective ran
            # behind the backward that produced this bucket's gradients, and once it is waited
            # for (and, under ZeRO-2/3, its shard copied out) its flat buffer is dead, so this
            # bucket can be flattened into the same memory (passes/reuse_buffers).
            if pending is not None:
                waits.append(call(g, c10d.wait_tensor.default, (pending,)))
            pieces = [call(g, aten.reshape.default, (n, [-1])) for n in nodes]  # a view when contiguous
            if padded != total:
                val = nodes[0].meta["val"]
                pieces.append(call(g, aten.zeros.default, ([padded - total],),
                                   {"dtype": val.dtype, "device": val.device}))
            if local:
                waits.append(_flatten(g, pieces, reduce_dtype))
                continue
            if role == "local":  # reduced by the step's last slice, summed with its own
                waits.append(_flatten(g, pieces, None, scale))
                continue
            if buf is not None:
                # Fills the persistent buffer; the collective reads cat's result (the buffer),
                # so the order is a data dependency.
                flat = call(g, aten.cat.out, (pieces,), {"out": buf})
                if acc is not None:
                    flat = call(g, aten.add_.Tensor, (flat, acc))
                coll = call(g, c10d.all_reduce_.default, (flat, "sum", group))
            else:
                coll = _flatten_and_reduce(g, pieces, scale, reduce_dtype, zero >= 2 and not via_all_reduce,
                                           world, group, via_exchange, acc)
        pending = coll
    if pending is not None:
        with g.inserting_before(out):
            waits.append(call(g, c10d.wait_tensor.default, (pending,)))
    if via_all_reduce:
        # Keep only this rank's shard: the copy lets the full reduced bucket die at once.
        for k, w in enumerate(waits):
            s = buckets[k].shard_size(world)
            with g.inserting_after(w):
                piece = call(g, aten.slice.Tensor, (w, 0, rank * s, (rank + 1) * s))
                with g.inserting_after(piece):
                    waits[k] = call(g, aten.clone.default, (piece,))
    if via_exchange:
        # Add the peers' chunks to this rank's own into a shard-size tensor, so the flat bucket dies here.
        for k, w in enumerate(waits):
            s = buckets[k].shard_size(world)
            flat = w.args[0].args[0]  # wait(exchange_scatter(flat, ...))
            with g.inserting_before(w.next):  # keeps the new nodes in creation order
                mine = call(g, aten.slice.Tensor, (flat, 0, rank * s, (rank + 1) * s))
                if world == 2:
                    # Into the received chunk, which nothing else reads: no new shard-size
                    # buffer. a + b == b + a, so it still equals the collective's sum.
                    waits[k] = call(g, aten.add_.Tensor, (w, mine))
                else:
                    theirs = call(g, aten.view.default, (w, [world - 1, s]))
                    theirs = call(g, aten.sum.dim_IntList, (theirs, [0]))
                    waits[k] = call(g, aten.add.Tensor, (mine, theirs))
    if reduce_dtype is not None:
        # Gradients reach the optimizer in their own dtype (fp32 master gradients).
        for k, w in enumerate(waits):
            want = outs[groups[k][0]].meta["val"].dtype
            if w.meta["val"].dtype != want:
                with g.inserting_before(out):
                    waits[k] = call(g, aten._to_copy.default, (w,), {"dtype": want})

    keep = [i for i, s in enumerate(sig.outputs) if s.kind != "grad"]
    out.args = (tuple([outs[i] for i in keep] + waits),)
    sig.outputs = [sig.outputs[i] for i in keep] + [IOSpec("grad_bucket", str(b.index)) for b in buckets]
    sig.inputs = sig.inputs + added
    sig.buckets = buckets
    return PassResult(gm, modified=True)


def _flatten(g: fx.Graph, pieces: list[fx.Node], reduce_dtype: torch.dtype | None, scale: float = 1.0,
             acc: fx.Node | None = None) -> fx.Node:
    """A new flat tensor of `pieces`, scaled, plus `acc` (the step's earlier slices) and cast as asked."""
    flat = call(g, aten.cat.default, (pieces,)) if len(pieces) > 1 else pieces[0]
    if scale != 1.0:
        flat = call(g, aten.mul.Tensor, (flat, scale))
    if acc is not None:
        flat = call(g, aten.add.Tensor, (flat, acc))
    if reduce_dtype is not None and reduce_dtype != flat.meta["val"].dtype:
        flat = call(g, aten._to_copy.default, (flat,), {"dtype": reduce_dtype})
    return flat


def _flatten_and_reduce(g: fx.Graph, pieces: list[fx.Node], scale: float, reduce_dtype: torch.dtype | None,
                        scatter: bool, world: int, group: str, exchange: bool = False,
                        acc: fx.Node | None = None) -> fx.Node:
    """The collective over a new flat tensor of `pieces` (scaled, plus `acc`, cast as asked); with
    `exchange`, the point-to-point half of a reduce-scatter (the caller adds the chunks)."""
    flat = _flatten(g, pieces, reduce_dtype, scale, acc)
    if exchange:
        return call(g, exchange_scatter, (flat, world, group))
    if scatter:
        return call(g, c10d.reduce_scatter_tensor.default, (flat, "sum", world, group))
    if len(pieces) > 1 or scale != 1.0 or acc is not None:
        # `flat` is a fresh buffer nothing else reads: reduce it in place, saving a copy.
        return call(g, c10d.all_reduce_.default, (flat, "sum", group))
    return call(g, c10d.all_reduce.default, (flat, "sum", group))
