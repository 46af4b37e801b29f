"""offload_activations: activations saved for backward leave the device after forward produces
them and come back just ahead of backward's first reader, so they take no device memory across
the middle of the step (where the peak is).

    before:  h = gelu(a)                      # forward
             y = mm(h, w) ...
             ... gw = mm(t(h), gy)            # backward reads h: h lives through the whole step
    after:   h = gelu(a); fxspeed.offload_activation(h, store, 3)
             y = mm(h, w) ...                 # h dies here, at its last forward reader
             fxspeed.prefetch_activation(store, 7)        # at the start of backward
             ...
             h' = fxspeed.reload_activation(store, 3, then=2, shape, stride, dtype, device)
             ... gw = mm(t(h'), gy)           # views of h that backward reads are made again from h'

What moves (the choice, from the annotated program): the storage *roots* of the values forward
saves for backward (a saved view moves as its base, and the views backward reads are re-created
from the reloaded base), when the root is a dense tensor of at least
`activation_offload_min_bytes`, nothing mutates it or returns it, and the compute between its
last forward reader and its first backward reader (FLOPs, from annotate) takes at least as long
as moving it out and back (`activation_offload_flops_per_byte`: the device's FLOP/s over the
offload link's bytes/s). The last layers' activations, read back almost at once, stay.

Reloads are chained: each starts the next one's copy (`then`), the first is started where
backward begins. Options read: activation_store (empty: the pass does nothing),
activation_offload_min_bytes, activation_offload_flops_per_byte.
why: docs/decisions/activation-offload.md
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from fxspeed.compiler.pass_manager import PassContext, PassResult, graph_pass
from fxspeed.compiler.rewrite import call, output_node
from fxspeed.ir import BACKWARD, FORWARD, META_KEY, STEP, is_dense, tensor_bytes
from fxspeed.runtime.offloaded_activations import (offload_activation_op, prefetch_activation_op,
                                                   reload_activation_op)


@dataclass
class _Candidate:
    root: fx.Node
    aliases: list[fx.Node] = field(default_factory=list)  # forward views of root (root first), graph order
    readers: list[tuple[fx.Node, fx.Node]] = field(default_factory=list)  # (backward reader, alias it reads)


@graph_pass("offload_activations", requires=("annotate",), invalidates=("annotate",))
def offload_activations(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    store = ctx.options.activation_store
    if not store:
        return PassResult(gm, modified=False)
    g = gm.graph
    moved = _sink_backward_views(g)
    nodes = list(g.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    flops_before = [0]  # FLOPs of the nodes before position i, for the compute between two readers
    for n in nodes:
        flops_before.append(flops_before[-1] + _flops(n))
    chosen = [c for c in _candidates(nodes) if _worth_moving(c, flops_before, order, ctx)]
    if not chosen:
        return PassResult(gm, modified=moved)
    reloads: list[tuple[fx.Node, int]] = []
    sizes: dict[int, int] = {}
    offloads: dict[int, fx.Node] = {}
    for key, c in enumerate(sorted(chosen, key=lambda c: order[c.root])):
        val = c.root.meta["val"]
        sizes[key] = tensor_bytes(val)
        with g.inserting_after(c.root):
            offloads[key] = call(g, offload_activation_op, (c.root, store, key))
        first = min((r for r, _ in c.readers), key=lambda r: order[r])
        with g.inserting_before(first):
            back = call(g, reload_activation_op, (store, key, -1, list(val.shape), list(val.stride()), val.dtype,
                                                  val.device))
            copies = {c.root: back}
            wanted = _chains(c)
            for a in c.aliases[1:]:  # graph order: a view's source is copied before it
                if a in wanted:
                    copies[a] = g.node_copy(a, lambda n: copies.get(n, n))
        for reader, alias in c.readers:
            reader.replace_input_with(alias, copies[alias])
        for a in reversed(c.aliases[1:]):  # views only backward read are dead now
            if not a.users:
                g.erase_node(a)
        reloads.append((back, key))
    order = {n: i for i, n in enumerate(g.nodes)}
    reloads.sort(key=lambda rk: order[rk[0]])
    for (node, _), (_, nxt) in zip(reloads, reloads[1:]):
        node.update_arg(2, nxt)
    # The first reload's copy starts where backward starts (after the loss) or, for an
    # activation offloaded later than that, right after its offload.
    first, key = reloads[0]
    start = max([offloads[key], *_losses(gm, ctx)], key=order.__getitem__)
    if order[start] < order[first]:
        with g.inserting_after(start):
            call(g, prefetch_activation_op, (store, key))
    ctx.signature.offloaded_activations = sizes
    return PassResult(gm, modified=True)


def _losses(gm: fx.GraphModule, ctx: PassContext) -> list[fx.Node]:
    out = output_node(gm)
    return [v for v, spec in zip(out.args[0], ctx.signature.outputs) if spec.kind == "loss" and isinstance(v, fx.Node)]


def _role(n: fx.Node) -> str | None:
    inf = n.meta.get(META_KEY)
    return inf.role if inf is not None else None


def _is_view(n: fx.Node) -> bool:
    """`n` returns (elements of) a view of its first argument."""
    if n.op != "call_function" or not n.args or not isinstance(n.args[0], fx.Node):
        return False
    if n.target is operator.getitem:  # an element of split/unbind is a view; of layer norm's tuple, not
        src = n.args[0]
        return isinstance(src.target, torch._ops.OpOverload) and src.target.is_view
    return isinstance(n.target, torch._ops.OpOverload) and n.target.is_view


def _source(n: fx.Node) -> fx.Node:
    """The value `n` views (through a view op's tuple for getitem)."""
    src = n.args[0]
    return src.args[0] if n.target is operator.getitem else src


def _sink_backward_views(g: fx.Graph) -> bool:
    """Move views that only backward reads (made where forward ran, or early in backward) down
    to just before their first reader, so a reload before that reader comes late, not early.
    Returns whether any moved."""
    moved = False
    order: dict[fx.Node, int] = {}
    for n in reversed(list(g.nodes)):
        if _is_view(n) and _role(n) == BACKWARD and n.users and n.target is not operator.getitem:
            if not order:  # numbered again after a move: it reorders the users of earlier views
                order = {m: i for i, m in enumerate(g.nodes)}
            first = min(n.users, key=order.__getitem__)
            if first.op != "output" and n.next is not first:
                first.prepend(n)
                order = {}
                moved = True
    return moved


def storage_root(n: fx.Node) -> fx.Node:
    """The node whose output owns `n`'s storage: `n` followed back through views."""
    while _is_view(n):
        n = _source(n)
    return n


def read_at_absolute_offset(n: fx.Node) -> bool:
    """Some reader of `n` (or of a view of it) addresses storage by absolute offset (as_strided)."""
    return any(_absolute_view(u) for u in n.users)


def _candidates(nodes: list[fx.Node]) -> list[_Candidate]:
    """Roots of forward values that backward reads, with their forward views and backward readers."""
    root_of: dict[fx.Node, fx.Node] = {}
    for n in nodes:
        root_of[n] = root_of.get(_source(n), _source(n)) if _is_view(n) else n
    found: dict[fx.Node, _Candidate] = {}
    refused: set[fx.Node] = set()
    for n in nodes:
        r = root_of[n]
        if r.op != "call_function" or _role(r) != FORWARD or r in refused:
            continue
        if n is not r and _role(n) != FORWARD:
            continue  # a view backward makes: a reader of its source, handled there
        c = found.setdefault(r, _Candidate(r))
        c.aliases.append(n)
        for u in n.users:
            mutable = isinstance(u.target, torch._ops.OpOverload) and u.target._schema.is_mutable
            if u.op == "output" or mutable or _absolute_view(u):
                # returned, written in place, or viewed at an absolute storage offset (a reloaded
                # tensor starts elsewhere in its storage): keep it where it is
                refused.add(r)
            elif _role(u) in (BACKWARD, STEP):  # backward's own views of n included: they read n
                c.readers.append((u, n))
    out = []
    for r, c in found.items():
        val = r.meta.get("val")
        if r in refused or not c.readers or not isinstance(val, torch.Tensor) or not is_dense(val) or val.numel() == 0:
            continue
        if "_c10d" in str(getattr(r.target, "namespace", "")) or r.target is operator.getitem and \
                not isinstance(r.args[0].target, torch._ops.OpOverload):
            continue
        out.append(c)
    return out


# Views that address their base's storage by absolute offset, not relative to the tensor.
_ABSOLUTE_VIEWS = {torch.ops.aten.as_strided.default, torch.ops.aten.as_strided_.default,
                   torch.ops.aten.as_strided_scatter.default, torch.ops.aten.as_strided_copy.default}


def _absolute_view(u: fx.Node) -> bool:
    """`u` or a view of it (backward's own views included) addresses storage by absolute offset."""
    stack, seen = [u], set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.target in _ABSOLUTE_VIEWS:
            return True
        if _is_view(n):
            stack.extend(m for m in n.users if m.op == "call_function")
    return False


def _worth_moving(c: _Candidate, flops_before: list[int], order: dict[fx.Node, int], ctx: PassContext) -> bool:
    size = tensor_bytes(c.root.meta["val"])
    if size < ctx.options.activation_offload_min_bytes:
        return False
    forward_reads = [order[u] for a in c.aliases for u in a.users if _role(u) == FORWARD]
    last_forward = max([order[c.root], *forward_reads])
    first_backward = min(order[r] for r, _ in c.readers)
    between = flops_before[first_backward] - flops_before[last_forward + 1]
    return between >= 2 * size * ctx.options.activation_offload_flops_per_byte  # out and back


def _flops(n: fx.Node) -> int:
    inf = n.meta.get(META_KEY)
    return inf.flops if inf is not None else 0


def _chains(c: _Candidate) -> set[fx.Node]:
    """The aliases backward reads, and every view between them and the root."""
    keep: set[fx.Node] = set()
    for _, alias in c.readers:
        a = alias
        while a is not c.root and a not in keep:
            keep.add(a)
            a = a.args[0]  # for an element of split/unbind: the split, then what it splits
    return keep
