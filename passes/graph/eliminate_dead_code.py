"""eliminate_dead_code: drop nodes whose values nothing reads.

    before: a = mm(x, w); b = relu(a); c = t(w)   # c unused
    after:  a = mm(x, w); b = relu(a)

Unlike fx's own DCE, a node that draws random numbers (dropout's bernoulli) is kept even
when unused: removing it would shift torch's RNG stream and change every later random op
compared to eager. Mutating ops are kept too, and checks of values (F.one_hot's range check,
`aten._assert_async`): they return nothing, but eager raises on a bad batch.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from fxspeed.compiler.pass_manager import PassContext, PassResult, graph_pass


def has_side_effects(n: fx.Node) -> bool:
    t = n.target
    if isinstance(t, torch._ops.OpOverload):
        return (t._schema.is_mutable or torch.Tag.nondeterministic_seeded in t.tags
                or t._overloadpacket is torch.ops.aten._assert_async)
    return n.op != "call_function" or n.is_impure()


@graph_pass("eliminate_dead_code", invalidates=("annotate",))
def eliminate_dead_code(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    removed = 0
    for n in reversed(list(gm.graph.nodes)):
        if n.op == "call_function" and not n.users and not has_side_effects(n):
            gm.graph.erase_node(n)
            removed += 1
    return PassResult(gm, modified=removed > 0)
