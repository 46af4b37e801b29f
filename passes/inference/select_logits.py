"""select_logits: compute the LM head only for the tokens a serving step samples from.

A step packs T tokens, but only the last token of each request that reached the end of what it
has (prompt fully cached, or a decode token) is sampled: a handful of rows. The LM head (a
[hidden, vocab] GEMM, for GPT-2 as large as a third of the model) is applied to those rows only:

    before:  h2 = view(h, [T, E]); l = mm(h2, t(W)); out = view(l, [1, T, V])      -> (out,)
    after:   h2 = view(h, [T, E]); r = index_select(h2, 0, logits_index)
             l = mm(r, t(W)); out = unsqueeze(l, 0)                                -> (out,)   [1, N, V]

New input: `logits_index` (IOSpec kind "logits_index"), the N row numbers; N may differ from the
traced one at run time (nothing after the selection has a baked-in size). Only a head reached
from the output through views is rewritten (`addmm` with a bias too); anything else (a soft-cap
after the head) leaves the graph unchanged and `gm.meta["selects_logits"]` False, and the
runtime then picks the rows out of all T. Reads no options.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from fxspeed.compiler.pass_manager import PassContext, PassResult, graph_pass
from fxspeed.compiler.rewrite import call, output_node
from fxspeed.ir import IOSpec

aten = torch.ops.aten
VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)


@graph_pass("select_logits", invalidates=("annotate",))
def select_logits(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    g = gm.graph
    gm.meta["selects_logits"] = False
    out = output_node(gm)
    (logits,) = out.args[0]
    n = logits
    while n.op == "call_function" and n.target in VIEWS and len(n.users) == 1:
        n = n.args[0]
    if n.op != "call_function" or n.target not in (aten.mm.default, aten.addmm.default) or len(n.users) != 1:
        return PassResult(gm, modified=False)
    x_i = 0 if n.target == aten.mm.default else 1
    x = n.args[x_i]
    T = logits.meta["val"].shape[1]
    if x.meta["val"].dim() != 2 or x.meta["val"].shape[0] != T:
        return PassResult(gm, modified=False)
    last = [p for p in g.nodes if p.op == "placeholder"][-1]
    with g.inserting_after(last):
        idx = g.placeholder("logits_index")
    idx.meta["val"] = torch.empty(T, dtype=torch.int64, device=x.meta["val"].device)
    ctx.signature.inputs.append(IOSpec("logits_index", ""))
    with g.inserting_before(n):
        rows = call(g, aten.index_select.default, (x, 0, idx))
    args = list(n.args)
    args[x_i] = rows
    with g.inserting_before(n):
        head = call(g, n.target, tuple(args), dict(n.kwargs))
    with g.inserting_before(out):
        new = call(g, aten.unsqueeze.default, (head, 0))
    chain = _chain(logits, n)
    out.args = ((new,),)
    for dead in reversed(list(g.nodes)):
        if dead in chain and not dead.users:
            g.erase_node(dead)
    gm.meta["selects_logits"] = True
    gm.recompile()
    return PassResult(gm, modified=True)


def _chain(top: fx.Node, bottom: fx.Node) -> set[fx.Node]:
    seen = {bottom}
    n = top
    while n is not bottom:
        seen.add(n)
        n = n.args[0]
    return seen
