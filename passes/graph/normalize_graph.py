"""normalize_graph: remove no-op aliases so later passes see one node per real value, and give
SiLU's gradient back its ATen op.

    before: d = detach(x); y = mul(d, 2)
    after:  y = mul(x, 2)

AOT export leaves `detach`/`alias` nodes from autograd bookkeeping. The captured graph is
functional (no in-place ops on intermediates), so an alias is the same value as its input.

    before: s = sigmoid(g); d = sub(fill(empty_like(s), 1), s); gg = mul(dy, mul(s, add(mul(g, d), 1)))
    after:  gg = silu_backward(dy, g)

The joint trace runs backward with grad mode on, where autograd takes SiLU's twice-differentiable
formula; eager's backward runs the `silu_backward` kernel. The formula rounds differently (1 ulp
of the gradient, 3e-7 in the weights after 3 AdamW steps on a Llama MLP) and is eight kernels
for one.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from fxspeed.compiler.pass_manager import PassContext, PassResult, graph_pass
from fxspeed.compiler.rewrite import call

from .activation_pattern import silu_grad_nodes
from .pattern_match import is_call, mul_operand

aten = torch.ops.aten
NO_OP_ALIASES = {aten.detach.default, aten.alias.default}


@graph_pass("normalize_graph", invalidates=("annotate",))
def normalize_graph(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    changed = False
    for n in list(gm.graph.nodes):
        if n.op == "call_function" and n.target in NO_OP_ALIASES:
            n.replace_all_uses_with(n.args[0])
            gm.graph.erase_node(n)
            changed = True
    changed |= _fold_silu_backward(gm.graph)
    return PassResult(gm, modified=changed)


def _fold_silu_backward(g: fx.Graph) -> bool:
    """Each gradient written as SiLU's formula (activation_pattern.silu_grad_nodes) becomes one
    `silu_backward` of the same gradient and input."""
    changed = False
    for sig in [n for n in g.nodes if is_call(n, aten.sigmoid.default, 1)]:
        x = sig.args[0]
        val = x.meta.get("val") if isinstance(x, fx.Node) else None
        if not isinstance(val, torch.Tensor):
            continue
        found = None
        for ds in sig.users:
            for gg in ds.users if is_call(ds, aten.mul.Tensor, 2) else ():
                dy = mul_operand(gg, ds)
                nodes = silu_grad_nodes(gg, dy, x, tuple(val.shape)) if dy is not None else None
                if nodes and len(nodes) > 1 and dy.meta["val"].dtype == val.dtype:
                    found = (gg, dy, nodes)
        if found is None:
            continue
        gg, dy, nodes = found
        with g.inserting_before(gg):
            op = call(g, aten.silu_backward.default, (dy, x))
        gg.replace_all_uses_with(op)
        for m in reversed(nodes):
            g.erase_node(m)
        changed = True
    return changed
