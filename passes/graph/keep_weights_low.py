"""keep_weights_low: trainable parameters enter the training step as low-precision working
copies, and their gradients leave it in the working precision (the ZeRO paper's mixed-precision
layout; the fp32 master weights live with the optimizer, in this rank's partition).

Runs after insert_casts, which made one low-precision twin of each parameter that a matmul,
convolution or attention reads. That twin becomes the input itself; an fp32 reader (a norm's
weight, a bias added in fp32) gets an upcast of the working copy, made just before it (one per
reader, so a ZeRO-3 gather is never kept alive from forward to backward for it); an embedding
looks its rows up in the working copy and upcasts the rows, not the table (the same values):

    before:  w: f32;  w16 = to(w, bf16); y = mm(x16, t(w16)); z = layer_norm(y, w) ...
             e = embedding(E, ids)                                  # E: f32
             g_w = to(mm(g16, x16), f32) ...          return (loss, g_w, g_E)
    after:   w: bf16; y = mm(x16, t(w)); z = layer_norm(y, to(w, f32)) ...
             e = to(embedding(E, ids), f32)                         # E: bf16
             g_w = mm(g16, x16) ...                   return (loss, g_w, to(g_E, bf16))

A gradient the graph computed in fp32 and cast back from a low-precision matmul leaves as that
matmul's output (no round trip). Gradients leave in `reduce_dtype` when it names a dtype
("fp32": fp32 gradients, twice the bytes), else in the working precision ("auto").

Numerics: the step computes what the fp32 graph computes from weights rounded to the working
precision, exactly (an upcast of a bf16 value is exact; every low-precision op read the rounded
weight already); gradients are those values rounded to their dtype.

Options read from ctx.options: master_weights, precision, reduce_dtype.
why: docs/decisions/master-weights-in-the-partition.md
"""

from __future__ import annotations

import torch
import torch.fx as fx

from fxspeed.compiler.pass_manager import PassContext, PassResult, graph_pass
from fxspeed.compiler.rewrite import call, fake_value, output_node
from fxspeed.ir import dtype_name
from fxspeed.passes.graph.insert_casts import LOW_DTYPES, _is_view

aten = torch.ops.aten
GRAD_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@graph_pass("keep_weights_low", invalidates=("annotate",))
def keep_weights_low(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    opts = ctx.options
    sig = ctx.signature
    if not opts.master_weights or opts.precision not in LOW_DTYPES:
        return PassResult(gm, modified=False)
    low = LOW_DTYPES[opts.precision]
    grad_dtype = GRAD_DTYPES.get(opts.reduce_dtype, low)
    g = gm.graph
    out = output_node(gm)
    outs = list(out.args[0])
    grad_at = {s.target: i for i, s in enumerate(sig.outputs) if s.kind == "grad"}
    placeholders = [n for n in g.nodes if n.op == "placeholder"]
    changed = False
    for spec, ph in zip(sig.inputs, placeholders):
        val = ph.meta.get("val")
        if spec.kind != "param" or spec.target not in grad_at or not isinstance(val, torch.Tensor) \
                or val.dtype != torch.float32:
            continue  # frozen weights (no master to keep) and non-fp32 ones stay as they are
        ph.meta["val"] = fake_value(aten._to_copy.default, (ph,), {"dtype": low})
        for u in list(ph.users):
            if u.op == "output":
                continue
            if u.target is aten._to_copy.default and dict(u.kwargs) == {"dtype": low}:
                u.replace_all_uses_with(ph)  # insert_casts' twin: the working copy itself
                g.erase_node(u)
            elif u.target is aten.embedding.default and u.args[0] is ph and ph not in u.args[1:]:
                _embed_low(g, u)
            else:
                with g.inserting_before(u):
                    up = call(g, aten._to_copy.default, (ph,), {"dtype": torch.float32})
                u.replace_input_with(ph, up)
        _sink_views(g, ph)
        changed = True
        i = grad_at[spec.target]
        outs[i] = _gradient_in(g, outs[i], grad_dtype, out)
        out.args = (type(out.args[0])(outs),)  # now: the next _gradient_in counts the output's reads
    if not changed:
        return PassResult(gm, modified=False)
    sig.working_dtype, sig.grad_dtype = dtype_name(low), dtype_name(grad_dtype)
    return PassResult(gm, modified=True)


def _sink_views(g: fx.Graph, ph: fx.Node) -> None:
    """Move the views of `ph` (W^T that insert_casts made at the top of the graph for its twin)
    to just before their first reader. A view ahead of its use would make ZeRO-3 gather the
    bucket there, at the start of the step, and keep every bucket alive through forward."""
    chain, stack = [], [ph]
    while stack:
        n = stack.pop()
        for u in n.users:
            if u.op == "call_function" and _is_view(u) and u not in chain:
                chain.append(u)
                stack.append(u)
    order = {n: i for i, n in enumerate(g.nodes)}
    for v in sorted(chain, key=order.__getitem__, reverse=True):  # a view's readers first
        readers = [u for u in v.users if u.op != "output"]
        if readers:
            first = min(readers, key=lambda u: order.get(u, len(order)))
            first.prepend(v)
            order[v] = order[first] - 0.5


def _embed_low(g: fx.Graph, emb: fx.Node) -> None:
    """embedding(E16, ids) upcast: the rows of the working copy, in fp32 (what the fp32 table's
    rows would be after rounding), without an fp32 copy of the whole table."""
    emb.meta["val"] = fake_value(emb.target, emb.args, dict(emb.kwargs))
    users = list(emb.users)
    with g.inserting_after(emb):
        up = call(g, aten._to_copy.default, (emb,), {"dtype": torch.float32})
    for u in users:
        u.replace_input_with(emb, up)


def _gradient_in(g: fx.Graph, grad: object, dtype: torch.dtype, out: fx.Node) -> object:
    """The gradient output `grad` in `dtype`: the low-precision value an fp32 cast-back came
    from, when there is one, else a cast of it."""
    if not isinstance(grad, fx.Node) or not isinstance(grad.meta.get("val"), torch.Tensor) \
            or grad.meta["val"].dtype == dtype:
        return grad
    src = grad.args[0] if grad.target is aten._to_copy.default and grad.args else None
    if isinstance(src, fx.Node) and isinstance(src.meta.get("val"), torch.Tensor) and src.meta["val"].dtype == dtype:
        if len(grad.users) == 1:  # only the output read the fp32 copy
            out.replace_input_with(grad, src)
            g.erase_node(grad)
        return src
    # Right where the gradient is made: the fp32 value dies at once, not at the end of backward.
    with g.inserting_after(grad):
        return call(g, aten._to_copy.default, (grad,), {"dtype": dtype})
