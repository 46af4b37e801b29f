"""step_in_backward: the optimizer steps each bucket of parameters inside backward, as soon as
the bucket's gradients are final and nothing later in the program reads those parameters; the
gradients die there instead of living to the end of backward as outputs.

    before:  ... gw2 = mm(gy2, x2) ... gx2 = mm(gy2, w2) ... gw1 = mm(gy1, x1) ...
             return (loss, gw2, gw1)                          # grads held until the step
    after:   ... gw2 = mm(gy2, x2) ... gx2 = mm(gy2, w2)
             fxspeed.step_parameters(store, ["w2"], [w2], [gw2])   # after w2's last reader
             ... gw1 = mm(gy1, x1)
             fxspeed.step_parameters(store, ["w1"], [w1], [gw1])
             return (loss,)

A bucket is the gradients in the order backward produces them, up to bucket_bytes (one call of
the optimizer per bucket, not per tensor). Its call goes after the last node that reads any of
its parameters or a view of one, or the wait of a collective reading one (the update is in
place: a later reader would see the new weights; reuse_buffers' `last_use`), and after its last
gradient. Left as outputs, stepped by the engine after the program
as before: a parameter the program returns or aliases into an output, a weight whose gradient
comes out under two names (tied weights not merged). The engine only sets
PassOptions.optimizer_store when one step at the end would be the same computation: one stage,
no accumulation, clipping, loss scaling or NaN check (all need every gradient first). A program
whose gradients are reduced in buckets (data-parallel replicas, master weights) is left to
step_buckets_in_backward, which steps the reduced buckets.
Options read: optimizer_store (empty: the pass does nothing), bucket_bytes.
why: docs/decisions/step-in-backward.md
"""

from __future__ import annotations

from collections import Counter

import torch.fx as fx

from fxspeed.compiler.pass_manager import PassContext, PassResult, graph_pass
from fxspeed.compiler.rewrite import output_node
from fxspeed.ir import tensor_bytes
from fxspeed.passes.memory.reuse_buffers import last_use
from fxspeed.runtime.step_in_backward import step_parameters_op


@graph_pass("step_in_backward", invalidates=("annotate",))
def step_in_backward(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    store = ctx.options.optimizer_store
    if ctx.options.world_size > 1 or ctx.options.master_weights:
        # The gradients will be reduced into buckets first: step_buckets_in_backward steps those.
        return PassResult(gm, modified=False)
    sig = ctx.signature
    g = gm.graph
    out = output_node(gm)
    values = list(out.args[0])
    if not store or len(values) != len(sig.outputs):
        return PassResult(gm, modified=False)
    placeholders = [n for n in g.nodes if n.op == "placeholder"]
    param_of = {spec.target: ph for spec, ph in zip(sig.inputs, placeholders) if spec.kind in ("param", "param_tp")}
    order = {n: i for i, n in enumerate(g.nodes)}
    canonical = [sig.tied.get(s.target, s.target) for s in sig.outputs]
    names_of = Counter(canonical)
    grads = [(i, s.target, values[i]) for i, s in enumerate(sig.outputs)
             if s.kind == "grad" and isinstance(values[i], fx.Node) and s.target in param_of
             and names_of[canonical[i]] == 1]
    eligible = []
    for i, name, grad in grads:
        last = last_use(param_of[name], order)  # its last reader, views and collectives included
        if last is not None:  # None: the parameter (or a view of it) is an output
            eligible.append((i, name, grad, max(last, order[grad])))
    if not eligible:
        return PassResult(gm, modified=False)
    eligible.sort(key=lambda e: order[e[2]])
    buckets: list[list[tuple[int, str, fx.Node, int]]] = [[]]
    size = 0
    for e in eligible:
        if buckets[-1] and size >= ctx.options.bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(e)
        size += tensor_bytes(e[2].meta.get("val"))
    nodes = list(g.nodes)
    stepped: list[str] = []
    for bucket in buckets:
        after = nodes[max(pos for *_, pos in bucket)]
        names = [name for _, name, _, _ in bucket]
        with g.inserting_after(after):
            call = g.call_function(step_parameters_op, (store, names, [param_of[n] for n in names],
                                                        [grad for _, _, grad, _ in bucket]))
        call.meta["val"] = None
        stepped += names
    gone = {i for bucket in buckets for i, *_ in bucket}
    out.args = (tuple(v for i, v in enumerate(values) if i not in gone),)
    sig.outputs = [s for i, s in enumerate(sig.outputs) if i not in gone]
    sig.stepped_in_backward = stepped
    return PassResult(gm, modified=True)

