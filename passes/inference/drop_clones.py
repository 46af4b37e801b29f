"""drop_clones: an inference program reads a value itself where the capture copied it.

An eval-mode capture records dropout (and a `.clone()` or `.contiguous()` of a value that already
has the layout) as `aten.clone`: a full copy of an activation, twice per GPT-2 layer (after the
attention and after the MLP, before each residual add). A forward-only program that never writes
its activations can read the value itself:

    before:  c = clone(h); y = add(c, r)
    after:   y = add(h, r)

Only where that changes nothing a reader can see: the copy has its input's shape, strides, dtype
and device (a dense input, `memory_format` unset or preserve: a layout-changing clone stays, later
views may need it); neither the input nor anything it is a view of (through view ops and the
pieces of split / unbind / chunk) is written in place by a node of the program (the paged
attention writes its cache inputs); and neither the copy nor a view of it is an output of the
program (the output would alias another value, perhaps a parameter). Reads no options.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from fxspeed.compiler.pass_manager import PassContext, PassResult, graph_pass

aten = torch.ops.aten


def _written(g: fx.Graph) -> set[fx.Node]:
    """Every node some op writes in place (an argument its schema marks as written)."""
    out: set[fx.Node] = set()
    for n in g.nodes:
        schema = getattr(n.target, "_schema", None) if n.op == "call_function" else None
        if schema is None or not schema.is_mutable:
            continue
        for i, a in enumerate(schema.arguments):
            if a.alias_info is None or not a.alias_info.is_write:
                continue
            v = n.args[i] if i < len(n.args) else n.kwargs.get(a.name)
            out.update(x for x in (v if isinstance(v, (list, tuple)) else [v]) if isinstance(x, fx.Node))
    return out


def _aliases(n: fx.Node) -> bool:
    """`n`'s result shares memory with its first argument: a view op, or one result of a
    multi-view op (split, unbind, chunk: `getitem` of a list of views)."""
    if n.op != "call_function" or not n.args or not isinstance(n.args[0], fx.Node):
        return False
    if n.target is operator.getitem:
        return _aliases(n.args[0])
    schema = getattr(n.target, "_schema", None)
    return schema is not None and bool(schema.returns) and schema.returns[0].alias_info is not None


def _base(n: fx.Node) -> fx.Node:
    """The value `n` is a view of, through every op whose result aliases its first argument."""
    while _aliases(n):
        n = n.args[0]
    return n


def _reaches_output(n: fx.Node) -> bool:
    """`n`, or a view of it, is an output of the program."""
    return any(u.op == "output" or (_aliases(u) and u.args[0] is n and _reaches_output(u)) for u in n.users)


def _same_layout(a: object, b: object) -> bool:
    return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape \
        and a.stride() == b.stride() and a.dtype == b.dtype and a.device == b.device


@graph_pass("drop_clones", invalidates=("annotate",))
def drop_clones(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    g = gm.graph
    written = {_base(n) for n in _written(g)}
    dropped = 0
    for n in list(g.nodes):
        if n.op != "call_function" or n.target != aten.clone.default or not isinstance(n.args[0], fx.Node):
            continue
        x = n.args[0]
        if n.kwargs.get("memory_format") not in (None, torch.preserve_format) \
                or not _same_layout(x.meta.get("val"), n.meta.get("val")) \
                or _reaches_output(n) or _base(x) in written or n in written:
            continue
        n.replace_all_uses_with(x)
        g.erase_node(n)
        dropped += 1
    return PassResult(gm, modified=dropped > 0)
