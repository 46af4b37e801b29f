"""shard_parameters (ZeRO-3): each rank holds only its shard of every parameter bucket; the
graph gathers a bucket just before its first use in forward, lets it die after its last
forward use, and gathers it again for backward. Gathers run one bucket ahead (prefetch).

    before:  forward(w0, w1, x):  t0 = t(w0); h = addmm(b, x, t0) ... backward uses t0, w1
    after:   forward(shard0, shard1, x):
               a0 = all_gather(shard0); w0 = view(slice(wait(a0)))   # just before first use
               a1 = all_gather(shard1)                               # prefetch next bucket
               t0 = t(w0); h = addmm(b, x, t0) ...                   # w0 freed after last fwd use
             backward:
               a1' = all_gather(shard1); w1' = ...; t0' = t(w0')     # views re-derived from the
               ...                                                   # backward gather

Forward views of a parameter that backward reads (the transposed weight of a Linear) are
re-derived from the backward gather, so nothing keeps a forward gather alive. Requires the
bucket layout from reduce_gradients and node roles from annotate.

Under bf16/fp16 the shards are cast before the all-gather, which then moves half the bytes;
under master weights (keep_weights_low) the shards are the working copies and need no cast.

With `gather_via_all_reduce` (the engine sets it on gloo) a bucket is gathered by placing this
rank's shard in a zero-filled full-size buffer and all-reducing it in place (x + 0 is exact):

    before:  a0 = all_gather(shard0)
    after:   a0 = all_reduce_(constant_pad_nd(shard0, [rank*s, (N-rank-1)*s]))

The padded buffer is a flat value that reuse_buffers then places in a reused workspace.

With `gather_via_exchange` (the engine sets it on gloo, where it takes precedence) the gather
is point-to-point (runtime/kernels/collectives.py): each rank sends its shard to every peer
and receives theirs into their slots, half the all-reduce's bytes:

    before:  a0 = all_reduce_(constant_pad_nd(shard0, [rank*s, (N-rank-1)*s]))
    after:   a0 = fxspeed.exchange_gather(shard0, N, group)   # reuse_buffers: exchange_gather_out
why: docs/decisions/zero-gather-via-all-reduce-on-gloo.md

A bucket whose readers in one phase are far apart (two or more other buckets read in between)
is gathered once per cluster of readers, not once per phase (see _clusters).
why: docs/decisions/zero3-regather-distant-readers.md

On one rank the pass runs only with parameter offload (`parameter_store`): the "gather" of the
whole bucket is an alias of it, the place passes/memory/offload_parameters.py reads it from the files.

Options read from ctx.options: world_size, rank, group_name, precision, gather_via_all_reduce,
gather_via_exchange, parameter_store.
"""

from __future__ import annotations

import bisect

import torch
import torch.fx as fx

from fxspeed.ir import BACKWARD, FORWARD, META_KEY, IOSpec
from fxspeed.compiler.pass_manager import PassContext, PassResult, graph_pass
from fxspeed.compiler.rewrite import call, cast_only_dtype

from fxspeed.passes.graph.insert_casts import LOW_DTYPES
from fxspeed.runtime.kernels.collectives import exchange_gather

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
GATHER_KEY = "fxspeed_gathers_bucket"


def _role(n: fx.Node) -> str:
    inf = n.meta.get(META_KEY)
    return inf.role if inf is not None else FORWARD


def _is_view(n: fx.Node) -> bool:
    return bool(getattr(n.target, "is_view", False))


@graph_pass("shard_parameters", requires=("gradient_buckets", "annotate"), invalidates=("annotate",))
def shard_parameters(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    world = ctx.options.world_size
    # One rank has nothing to gather, except with parameter offload: its "shard" is the whole
    # bucket, read from the files at the place a gather would be (passes/memory/offload_parameters).
    if ctx.options.zero < 3 or (world == 1 and not ctx.options.parameter_store):
        return PassResult(gm, modified=False)
    group = ctx.options.dp_group("shard_parameters") if world > 1 else ""
    via_exchange = ctx.options.gather_via_exchange
    via_all_reduce = ctx.options.gather_via_all_reduce and not via_exchange
    rank = ctx.options.rank
    sig = ctx.signature
    g = gm.graph
    placeholders = [n for n in g.nodes if n.op == "placeholder"]
    # a tensor-parallel slice ("param_tp") is sharded over dp like a whole parameter
    by_name = {sig.inputs[i].target: ph for i, ph in enumerate(placeholders) if sig.inputs[i].kind in ("param", "param_tp")}
    # Under bf16/fp16 every bucket is cast as a shard and gathered in low precision (half the
    # bytes). A parameter read only through its one low-precision cast (insert_casts made it)
    # takes the gathered view directly; one also read in fp32 (a norm's weight) gets a single
    # upcast of it, as every mixed-precision engine computes from low-precision copies.
    low = LOW_DTYPES.get(ctx.options.precision)
    roots: dict[str, fx.Node] = dict(by_name)
    if low is not None:
        for b in sig.buckets:
            for name in b.names:
                if cast_only_dtype(by_name[name]) == low:
                    roots[name] = next(iter(by_name[name].users))  # the cast stands for the parameter
    order = {n: i for i, n in enumerate(g.nodes)}

    # New inputs: one flat shard per bucket, after the existing placeholders.
    shards: list[fx.Node] = []
    with g.inserting_after(placeholders[-1]):
        for b in reversed(sig.buckets):
            ph = g.placeholder(f"param_shard_{b.index}")
            ph.meta["val"] = _shard_val(by_name[b.names[0]], b.shard_size(world))
            shards.insert(0, ph)

    # Backward first: forward views of a parameter (W^T) still hang off its placeholder, so the
    # backward users reached through them can be moved onto copies fed by the backward gather.
    for phase in (BACKWARD, FORWARD):
        # Nodes of this phase that read each bucket (through forward views for backward), cut
        # into clusters that each get their own gather.
        users = {b.index: {name: _phase_users(roots[name], phase) for name in b.names} for b in sig.buckets}
        items = [(order[c[0]], k, set(c)) for k, c in _clusters(users, order)]
        items.sort(key=lambda it: it[0])
        prev_wait: fx.Node | None = None
        for first, k, cluster in items:
            b = sig.buckets[k]
            anchor = next(n for n in g.nodes if order.get(n) == first)
            # Issue the gather one bucket ahead: right after the previous bucket's wait.
            with g.inserting_before(prev_wait.next if prev_wait is not None else anchor):
                src = shards[k]
                if low is not None and src.meta["val"].dtype != low:  # not already a working copy
                    src = call(g, aten._to_copy.default, (src,), {"dtype": low})
                if world == 1:  # the bucket itself (an alias marks where its fetch goes)
                    gathered = call(g, aten.alias.default, (src,))
                elif via_exchange:
                    gathered = call(g, exchange_gather, (src, world, group))
                elif via_all_reduce:
                    s = b.shard_size(world)
                    placed = call(g, aten.constant_pad_nd.default, (src, [rank * s, (world - rank - 1) * s], 0.0))
                    gathered = call(g, c10d.all_reduce_.default, (placed, "sum", group))
                else:
                    gathered = call(g, c10d.all_gather_into_tensor.default, (src, world, group))
                gathered.meta[GATHER_KEY] = b.index  # which bucket this collective gathers
            with g.inserting_before(anchor):
                full = call(g, c10d.wait_tensor.default, (gathered,)) if world > 1 else gathered
                for name, shape, off in zip(b.names, b.shapes, b.offsets):
                    if not cluster.intersection(users[k][name]):
                        continue
                    n = 1
                    for d in shape:
                        n *= d
                    flat = call(g, aten.slice.Tensor, (full, 0, off, off + n))
                    param = call(g, aten.view.default, (flat, list(shape)))
                    if param.meta["val"].dtype != roots[name].meta["val"].dtype:
                        param = call(g, aten._to_copy.default, (param,), {"dtype": roots[name].meta["val"].dtype})
                    _rewire(g, roots[name], param, phase, cluster)
            prev_wait = full if world > 1 else None  # one rank: nothing to issue ahead
        order = {n: i for i, n in enumerate(g.nodes)}

    sharded = {n for b in sig.buckets for n in b.names}
    for name in sharded:
        if roots[name] is not by_name[name]:
            g.erase_node(roots[name])
        g.erase_node(by_name[name])
    # Shard placeholders were inserted after the last input, so graph order is: survivors, shards.
    sig.inputs = [s for s in sig.inputs if not (s.kind in ("param", "param_tp") and s.target in sharded)] + [
        IOSpec("param_shard", str(b.index)) for b in sig.buckets]
    return PassResult(gm, modified=True)


def _shard_val(param: fx.Node, size: int) -> torch.Tensor:
    val = param.meta["val"]
    return val.new_empty(size)


def _phase_users(root: fx.Node, phase: str) -> list[fx.Node]:
    """Users in `phase` of `root`, looking through forward view chains for backward."""
    found: list[fx.Node] = []
    stack = [root]
    while stack:
        n = stack.pop()
        for u in n.users:
            if u.op == "output":
                continue
            r = _role(u)
            if r == phase:
                found.append(u)
            elif phase == BACKWARD and r == FORWARD and _is_view(u):
                stack.append(u)
    return found


def _clusters(users: dict[int, dict[str, list[fx.Node]]], order: dict[fx.Node, int]
              ) -> list[tuple[int, list[fx.Node]]]:
    """(bucket, its users in graph order) per gather: a bucket's users in one phase, cut wherever
    two or more other buckets are read between two of them.

    A GPT's last gradient bucket holds the tied embedding and the first block's norms: read at
    the start of backward (the head's input gradient) and again at its end, so it gets two
    gathers per phase. why: docs/decisions/zero3-regather-distant-readers.md"""
    flat = sorted((order[u], k) for k, by_name in users.items() for us in by_name.values() for u in us)
    positions = [p for p, _ in flat]
    out = []
    for k, by_name in users.items():
        us = sorted({u for lst in by_name.values() for u in lst}, key=order.__getitem__)
        if not us:
            continue
        current = [us[0]]
        for a, b in zip(us, us[1:]):
            lo, hi = bisect.bisect_right(positions, order[a]), bisect.bisect_left(positions, order[b])
            if len({kk for _, kk in flat[lo:hi] if kk != k}) >= 2:
                out.append((k, current))
                current = []
            current.append(b)
        out.append((k, current))
    return out


def _rewire(g: fx.Graph, root: fx.Node, replacement: fx.Node, phase: str, only: set[fx.Node]) -> None:
    """Point the `phase` users of `root` that are in `only` at `replacement`; for backward,
    re-derive the forward views they read through."""
    copies = {root: replacement}
    stack = [root]
    while stack:
        n = stack.pop()
        for u in list(n.users):
            if u.op == "output":
                continue
            r = _role(u)
            if r == phase:
                if u in only:
                    u.replace_input_with(n, copies[n])
            elif phase == BACKWARD and r == FORWARD and _is_view(u):
                if u not in copies:
                    with g.inserting_after(copies[n]):
                        c = g.node_copy(u, lambda a: copies.get(a, a))
                        c.meta = {"val": u.meta["val"], META_KEY: u.meta.get(META_KEY)}
                    copies[u] = c
                    stack.append(u)
    # View copies whose readers all belong to another cluster: drop them (newest first).
    for c in reversed(list(copies.values())[1:]):
        if not c.users:
            g.erase_node(c)
