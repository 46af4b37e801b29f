"""recompute_checkpointed: recompute `torch.utils.checkpoint` regions in backward instead of
keeping their values alive from forward to backward.

Capture traces a checkpointed function directly and tags the nodes it created with
`meta["recompute"] = region` (fxspeed/compiler/checkpoint_regions.py). In the joint graph,
every tagged forward value that backward reads is recomputed just before its first backward
reader, from the values the region read (its inputs, parameters, values of other regions),
which stay saved as torch's checkpoint saves them:

    before:  h = mm(x, w1); a = gelu(h); y = mm(a, w2)          # region 0: h, a
             ... rest of forward ...
             g_w2 = mm(t(g_y), a); g_a = mm(g_y, t(w2))
             g_h = gelu_backward(g_a, h)                         # h and a live across forward
    after:   h = mm(x, w1); a = gelu(h); y = mm(a, w2)          # h and a die here
             ... rest of forward ...
             h_r = mm(x, w1); a_r = gelu(h_r)                    # recomputed (x, w1 saved)
             g_w2 = mm(t(g_y), a_r); g_a = mm(g_y, t(w2))
             g_h = gelu_backward(g_a, h_r)

Each clone is placed before the first backward node reading it or a clone made from it, so
recomputed values live no longer than backward needs them. Originals no forward node reads
any more are removed.

What is not recomputed (it stays saved, as without checkpointing):
  - random ops (dropout's native_dropout, bernoulli, rand*, ...): the mask drawn in forward
    is reused, so results equal eager (torch's checkpoint replays the RNG to the same effect);
  - mutating or otherwise impure ops, and anything not an ATen op or a getitem of one;
  - the region's outputs (values a forward node outside the region or the graph's output
    reads): saved by their readers outside, as in eager;
  - untagged nodes; casts that `insert_casts` placed on a region's values join the region.

Without tagged nodes the pass does nothing. Options read: none.
why: docs/decisions/recompute-checkpointed.md
"""

from __future__ import annotations

import operator
from typing import Callable

import torch
import torch.fx as fx

from fxspeed.compiler.checkpoint_regions import RECOMPUTE_KEY
from fxspeed.compiler.pass_manager import PassContext, PassResult, graph_pass
from fxspeed.ir import FORWARD, META_KEY

aten = torch.ops.aten
prims = torch.ops.prims

CASTS = {aten._to_copy.default, prims.convert_element_type.default}
_RANDOM_NAMES = ("dropout", "bernoulli", "rand", "normal", "uniform", "exponential", "multinomial", "poisson",
                 "cauchy", "geometric", "log_normal")


def is_recomputable_op(n: fx.Node) -> bool:
    """A pure, deterministic ATen op (or a getitem of one): recomputing it gives the same value."""
    if n.op != "call_function":
        return False
    t = n.target
    if t is operator.getitem:
        src = n.args[0]
        return isinstance(src, fx.Node) and is_recomputable_op(src)
    if not isinstance(t, torch._ops.OpOverload):
        return False
    if t._schema.is_mutable or torch.Tag.nondeterministic_seeded in t.tags or n.is_impure():
        return False
    name = t._schema.name.split("::")[-1]
    return not any(r in name for r in _RANDOM_NAMES)


def clone_into_backward(graph: fx.Graph, order: list[fx.Node], backward_users: Callable[[fx.Node], list[fx.Node]],
                        tag: str, drop: tuple[str, ...] = ()) -> dict[fx.Node, fx.Node]:
    """Clone each node of `order` (forward nodes, in graph order, closed under the inputs the
    clones should read as clones) right before its first backward reader or the first clone
    reading it, and point its backward readers at the clone; `meta[tag]` names the original,
    meta keys in `drop` are not copied. Returns original -> clone. The originals are left for the
    caller to erase where forward no longer reads them."""
    nodes = list(graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    at: dict[fx.Node, int] = {}
    for n in reversed(order):
        at[n] = min([index[u] for u in backward_users(n)] + [at[u] for u in n.users if u in at])
    clone: dict[fx.Node, fx.Node] = {}
    for n in sorted(order, key=lambda n: (at[n], index[n])):
        with graph.inserting_before(nodes[at[n]]):
            c = graph.node_copy(n, lambda a: clone.get(a, a))
        c.meta = {k: v for k, v in n.meta.items() if k not in drop}
        c.meta[tag] = n.name
        clone[n] = c
    clones = set(clone.values())
    for n in order:
        for u in backward_users(n):
            if u not in clones:
                u.replace_input_with(n, clone[n])
    return clone


def has_checkpointed_regions(gm: fx.GraphModule) -> bool:
    """Whether capture tagged any node as inside a `torch.utils.checkpoint` region."""
    return any(isinstance(n.meta.get(RECOMPUTE_KEY), int) for n in gm.graph.nodes)


def _is_forward(n: fx.Node) -> bool:
    inf = n.meta.get(META_KEY)
    return inf is not None and inf.role == FORWARD


@graph_pass("recompute_checkpointed", requires=("annotate",), invalidates=("annotate",))
def recompute_checkpointed(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    graph = gm.graph
    nodes = list(graph.nodes)
    region: dict[fx.Node, int] = {n: n.meta[RECOMPUTE_KEY] for n in nodes
                                  if n.op == "call_function" and isinstance(n.meta.get(RECOMPUTE_KEY), int)}
    if not region:
        return PassResult(gm, modified=False)
    forward = {n for n in nodes if _is_forward(n)}
    for n in nodes:  # a cast of a region's value (insert_casts) belongs to the region
        if n not in region and n in forward and n.target in CASTS and isinstance(n.args[0], fx.Node) \
                and n.args[0] in region:
            region[n] = region[n.args[0]]
    index = {n: i for i, n in enumerate(nodes)}

    def boundary(n: fx.Node) -> bool:  # read outside its region in forward, or a graph output
        return any(u.op == "output" or (u in forward and region.get(u) != region[n]) for u in n.users)

    def candidate(n: fx.Node) -> bool:
        return n in region and n in forward and is_recomputable_op(n) and not boundary(n)

    def backward_users(n: fx.Node) -> list[fx.Node]:
        return [u for u in n.users if u not in forward and u.op != "output"]

    wanted = [n for n in nodes if candidate(n) and backward_users(n)]
    if not wanted:
        return PassResult(gm, modified=False)
    # The nodes to clone: what the wanted values are computed from inside their region.
    closure: set[fx.Node] = set()
    stack = list(wanted)
    while stack:
        n = stack.pop()
        if n in closure:
            continue
        closure.add(n)
        stack.extend(a for a in n.all_input_nodes if candidate(a) and region[a] == region[n])
    order = sorted(closure, key=index.__getitem__)
    clone_into_backward(graph, order, backward_users, "recomputed_from", drop=(RECOMPUTE_KEY,))
    # Originals forward no longer reads: gone (their readers first).
    for n in reversed(nodes):
        if n in region and not n.users and is_recomputable_op(n):
            graph.erase_node(n)
    return PassResult(gm, modified=True)
