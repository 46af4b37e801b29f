"""keep_activations_low: what a low-precision matmul makes stays low through the ops that
follow it, as under eager autocast.

insert_casts runs matmuls, convolutions and attention in bf16/fp16 and casts each of their
outputs back to fp32 for every other reader. Eager autocast does not: an activation, a dropout,
a view or an elementwise product after a linear layer runs in the dtype it is given, so it reads
and writes half the bytes and backward keeps half-size copies. This pass gives the traced graph
that dataflow:

    before:  y16 = addmm(b16, x16, w16t); y = to(y16, f32); z = gelu(y); z16 = to(z, bf16)
             o16 = mm(z16, v16t) ...    dz = gelu_backward(to(dz16, f32), y)   # y kept in fp32
    after:   y16 = addmm(b16, x16, w16t); z16 = gelu(y16)
             o16 = mm(z16, v16t) ...    dz16 = gelu_backward(dz16, y16)        # y16 kept

The rule, per node in graph order, for a node from `FOLLOWING` (views, elementwise activations,
dropout, +, -, *, /, where, cat, masked_fill and their backward ops):
- every floating input is low (an fp32 cast-back of a low value): the node reads the low values
  and runs low, as autocast runs it; its own readers that do not follow get one cast-back;
- some input is a cast-back, another an fp32 tensor: the node reads the low value and ATen
  promotes (the same fp32 values, exactly: an upcast is exact), one cast kernel and one fp32
  copy fewer;
- otherwise (norms, softmax, losses, reductions, any op not listed) it reads fp32, as before.
A cast to the low dtype of a cast-back is the value itself (insert_casts' twin for the next
matmul). Two exceptions keep autocast's precision where the graph does not say what autocast
would do: a sum of two low gradients in backward (autograd sums the gradients of an fp32 value in
fp32: the matmul's input was an fp32 value cast inside autocast) stays fp32, and only values
made by a low-precision op count as low (an embedding row of a bf16 working copy is an fp32 value
in autocast: the residual stream stays fp32).

Numerics: a node that runs low computes what autocast computes there (ATen's bf16/fp16
elementwise kernels compute in fp32 and round the result once); a forward chain that only feeds
the next matmul gives the same values as before (the matmul rounded them anyway).

Options read from ctx.options: precision ("bf16" | "fp16"; "fp32" does nothing), low_activations
("always", the default, Config.low_activations=True; "cuda": programs on CUDA only; "off").
why: docs/decisions/keep-activations-low.md
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from fxspeed.compiler.pass_manager import PassContext, PassResult, graph_pass
from fxspeed.compiler.rewrite import fake_value, wanted_on
from fxspeed.ir import BACKWARD, META_KEY
from fxspeed.passes.graph.insert_casts import LOW_DTYPES, LOW_OPS, _cast_back, _is_view

aten = torch.ops.aten


def _ops(*names: str) -> frozenset[Any]:
    """The overloads named `op.overload` that this torch build has."""
    found = []
    for name in names:
        op, _, overload = name.partition(".")
        packet = getattr(aten, op, None)
        if packet is not None and hasattr(packet, overload or "default"):
            found.append(getattr(packet, overload or "default"))
    return frozenset(found)


# Ops that autocast runs in the dtype of their inputs (not on its fp32 list), forward and backward.
FOLLOWING = _ops(
    "_unsafe_view", "clone", "split.Tensor", "split_with_sizes", "unbind.int", "cat",
    "gelu", "silu", "relu", "tanh", "sigmoid", "neg", "native_dropout",
    "add.Tensor", "sub.Tensor", "mul.Tensor", "div.Tensor", "where.self", "masked_fill.Scalar",
    "gelu_backward", "silu_backward", "threshold_backward", "tanh_backward", "sigmoid_backward",
    "native_dropout_backward", "slice_backward", "select_backward")
# In backward, a sum of two gradients of one value: autocast's autograd adds them in fp32 when
# the value was fp32 (a matmul's input cast inside autocast), which the traced graph cannot tell.
_SUMS = _ops("add.Tensor", "sub.Tensor")


def _floating(v: Any) -> bool:
    return isinstance(v, torch.Tensor) and v.is_floating_point()


def _dtypes(val: Any) -> list[torch.dtype]:
    vals = val if isinstance(val, (tuple, list)) else [val]
    return [v.dtype for v in vals if _floating(v)]


@graph_pass("keep_activations_low", requires=("annotate",), invalidates=("annotate",))
def keep_activations_low(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    precision = ctx.options.precision
    if precision not in LOW_DTYPES or not wanted_on(gm, ctx.options.low_activations):
        return PassResult(gm, modified=False)
    low = LOW_DTYPES[precision]
    g = gm.graph
    made_low = {n for n in g.nodes if n.op == "call_function" and (n.target in LOW_OPS or (
        n.target is operator.getitem and isinstance(n.args[0], fx.Node) and n.args[0].target in LOW_OPS))}
    # fp32 cast-back -> the low value it came from (insert_casts' cast-backs, and this pass's)
    raw_of: dict[fx.Node, fx.Node] = {}
    for n in g.nodes:
        if n.target is aten._to_copy.default and dict(n.kwargs) == {"dtype": torch.float32} \
                and isinstance(src := n.args[0], fx.Node) and src in made_low \
                and _floating(v := src.meta.get("val")) and v.dtype == low:
            raw_of[n] = src
    changed = False
    for n in list(g.nodes):
        if n.op != "call_function" or n in raw_of:
            continue
        if n.target is aten._to_copy.default and dict(n.kwargs) == {"dtype": low} and n.args[0] in raw_of:
            n.replace_all_uses_with(raw_of[n.args[0]])  # a round trip: the low value itself
            g.erase_node(n)
            changed = True
            continue
        if n.target not in FOLLOWING and not _is_view(n):
            continue
        inputs = [a for a in n.all_input_nodes if _floating(a.meta.get("val"))]
        if not any(a in raw_of for a in inputs):
            continue
        all_low = all(a in raw_of for a in inputs)
        inf = n.meta.get(META_KEY)
        if all_low and n.target in _SUMS and inf is not None and inf.role == BACKWARD:
            continue
        args, kwargs = fx.node.map_arg((n.args, n.kwargs), lambda a: raw_of.get(a, a))
        val = fake_value(n.target, args, kwargs)
        # a 0-dim fp32 operand does not promote: such a node would silently round to low
        if set(_dtypes(val)) != ({low} if all_low else set(_dtypes(n.meta["val"]))):
            continue
        n.args, n.kwargs = args, kwargs
        was, n.meta["val"] = n.meta["val"], val
        changed = True
        if all_low:
            _cast_back(g, n, raw_of, was)  # its readers see an fp32 cast-back, which the next ones look through
    for back in list(raw_of):
        if not back.users:
            g.erase_node(back)
    return PassResult(gm, modified=changed)
