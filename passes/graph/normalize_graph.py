"""normalize_graph: remove no-op aliases so later passes see one node per real value.

    before: d = detach(x); y = mul(d, 2)
    after:  y = mul(x, 2)

AOT export leaves `detach`/`alias` nodes from autograd bookkeeping. The captured graph is
functional (no in-place ops on intermediates), so an alias is the same value as its input.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from fxspeed.compiler.pass_manager import PassContext, PassResult, graph_pass

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
    return PassResult(gm, modified=changed)
