"""fold_norm_casts: the cast to bf16/fp16 after a fused norm is folded into the norm, which writes
its normalized output in that dtype (the ops' `out_dtype`, runtime/kernels/norms.py and
residual_norms.py).

In bf16/fp16 programs insert_casts keeps norms in fp32 and casts their output down before the
next matmul: the norm writes an fp32 row, the cast reads it back and writes the bf16 row.

    before:  n = fxspeed.rms_norm_fwd(x, [C], w, eps)              # x fp32
             y = getitem(n, 0)                                     # fp32
             c = aten._to_copy(y, dtype=bf16)   (or prims.convert_element_type(y, bf16))
             ... = aten.mm(c, ...)
    after:   n = fxspeed.rms_norm_fwd(x, [C], w, eps, bf16)
             y = getitem(n, 0)                                     # bf16
             ... = aten.mm(y, ...)

and the same for fxspeed.layer_norm_fwd (y = n[0]) and the fused residual forms
fxspeed.add_layer_norm_fwd / add_rms_norm_fwd (y = n[1]; h and the statistics are unchanged).
Per row of C elements: 4C + 2C bytes less written and read (the fp32 output and its read back),
one kernel launch less.

Exact forms only; anything else is left as it is:
  - the op has no out_dtype yet, its y is fp32 (so the op rounds once, from fp32, what the cast
    did: the kernels round to nearest even as torch's `.to`; the fallback is `.to` itself);
  - every reader of y (of every getitem of that index) is a cast of y alone to one low dtype
    (bf16 or fp16): aten._to_copy with dtype and nothing that changes device, layout or memory
    format, or prims.convert_element_type. A y read in fp32 too (the residual stream, a view
    before the cast, the graph's output) is not folded: it would then be needed in both dtypes.
  - the cast's value and the new y agree in shape, dtype, device and strides, else the graph is
    left as it was.
The copies recompute_pointwise puts into backward ("recomputed_pointwise") are norm forwards too
and fold the same way. The op node is rewritten in place (its name, meta and module kept): its
arguments get the dtype, meta["val"] is recomputed (y's entry in the low dtype), the y getitem is
retyped, each cast's readers read the getitem, and the casts are erased. Values are bit-identical.

compile_step and compile_inference run it last where the fusion passes run (after
fuse_residual_norms: it sees the op each norm ends as). Disabled by
name ("fold_norm_casts"). Options read: none.
"""

from __future__ import annotations

import operator
from typing import Any, Optional

import torch
import torch.fx as fx

from fxspeed.compiler.pass_manager import PassContext, PassResult, graph_pass
from fxspeed.compiler.rewrite import fake_value

from .insert_casts import LOW_DTYPES
from .pattern_match import tensor_value

aten = torch.ops.aten
prims = torch.ops.prims

_LOW = frozenset(LOW_DTYPES.values())


def _foldable() -> dict[Any, tuple[int, int]]:
    """fused norm forward -> (the number of arguments before out_dtype, the index of y in its outputs)."""
    import fxspeed.runtime.kernels.residual_norms  # noqa: F401  registers the fxspeed:: ops (triton is not imported)

    ops = torch.ops.fxspeed
    return {ops.layer_norm_fwd.default: (5, 0), ops.rms_norm_fwd.default: (4, 0),
            ops.add_layer_norm_fwd.default: (6, 1), ops.add_rms_norm_fwd.default: (5, 1)}


def _keeps_layout(key: str, v: Any, y: torch.Tensor) -> bool:
    """An _to_copy keyword argument other than dtype that changes nothing but the dtype."""
    if key == "layout":
        return v in (None, torch.strided)
    if key == "device":
        return v is None or torch.device(v) == y.device
    if key in ("pin_memory", "non_blocking"):
        return not v
    if key == "memory_format":
        return v in (None, torch.preserve_format) or (v == torch.contiguous_format and y.is_contiguous())
    return False


def cast_dtype(c: fx.Node, y: fx.Node) -> Optional[torch.dtype]:
    """The low dtype (bf16/fp16) when c casts y, and only changes its dtype; else None."""
    yv, cv = tensor_value(y), tensor_value(c)
    if c.op != "call_function" or yv is None or cv is None:
        return None
    if c.target is aten._to_copy.default and c.args == (y,):
        kw = dict(c.kwargs)
        low = kw.pop("dtype", None)
        if not all(_keeps_layout(k, v, yv) for k, v in kw.items()):
            return None
    elif c.target is prims.convert_element_type.default and len(c.args) == 2 and c.args[0] is y and not c.kwargs:
        low = c.args[1]
    else:
        return None
    return low if low in _LOW and cv.dtype == low else None


def _has_out_dtype(n: fx.Node, before: int) -> bool:
    return len(n.args) > before or n.kwargs.get("out_dtype") is not None


def _same_layout(a: Optional[torch.Tensor], b: Optional[torch.Tensor]) -> bool:
    """Same shape, dtype, device and strides (those of size-1 dims aside: no index reads them)."""
    return (a is not None and b is not None and a.shape == b.shape and a.dtype == b.dtype and a.device == b.device
            and all(s == t for s, t, k in zip(a.stride(), b.stride(), a.shape) if k > 1))


def match(n: fx.Node,
          table: dict[Any, tuple[int, int]]) -> Optional[tuple[torch.dtype, list[fx.Node], list[fx.Node]]]:
    """(low dtype, y's getitems, the casts reading them) when n's y output is read only by casts to
    one low dtype; else None."""
    if n.op != "call_function" or n.target not in table:
        return None
    before, at = table[n.target]
    if _has_out_dtype(n, before) or set(n.kwargs) - {"out_dtype"} or len(n.args) != before:
        return None
    ys, casts, lows = [], [], set()
    for g in n.users:
        if g.op != "call_function" or g.target is not operator.getitem or g.args[0] is not n:
            return None  # something reads the op's tuple itself
        if g.args[1] != at:
            continue
        v = tensor_value(g)
        if v is None or v.dtype != torch.float32 or not g.users:
            return None
        for c in g.users:
            low = cast_dtype(c, g)
            if low is None:
                return None  # read in fp32 (or through a view, or cast to something else)
            lows.add(low)
            casts.append(c)
        ys.append(g)
    if not ys or len(lows) != 1:
        return None
    return lows.pop(), ys, casts


def fold(graph: fx.Graph, n: fx.Node, low: torch.dtype, ys: list[fx.Node], casts: list[fx.Node],
         at: int) -> bool:
    """Pass `low` to n and let y's readers read y; False, the graph as it was, if the values disagree."""
    args, kwargs = ((n.args, {**n.kwargs, "out_dtype": low}) if "out_dtype" in n.kwargs
                    else ((*n.args, low), dict(n.kwargs)))
    try:
        val = fake_value(n.target, args, kwargs)
    except (RuntimeError, ValueError):
        return False
    old = n.meta.get("val")
    if not (isinstance(old, (tuple, list)) and len(old) == len(val)):
        return False
    if not all(i == at or _same_layout(a, b) for i, (a, b) in enumerate(zip(val, old))):
        return False
    if not all(_same_layout(val[at], tensor_value(c)) for c in casts):
        return False
    n.args, n.kwargs = args, kwargs
    n.meta["val"] = val
    n.meta.pop("tensor_meta", None)
    for g in ys:
        g.meta["val"] = val[at]
        g.meta.pop("tensor_meta", None)
    for c in casts:
        c.replace_all_uses_with(c.args[0])
        graph.erase_node(c)
    return True


def fold_norm_casts_in(graph: fx.Graph) -> int:
    """Fold every foldable cast of `graph`; the number of norm ops given an out_dtype."""
    table = _foldable()
    count = 0
    for n in list(graph.nodes):
        found = match(n, table)
        if found is not None and fold(graph, n, *found, table[n.target][1]):
            count += 1
    return count


@graph_pass("fold_norm_casts", invalidates=("annotate",))
def fold_norm_casts(gm: fx.GraphModule, ctx: PassContext) -> PassResult:  # noqa: ARG001
    return PassResult(gm, modified=fold_norm_casts_in(gm.graph) > 0)


__all__ = ["cast_dtype", "fold", "fold_norm_casts", "fold_norm_casts_in", "match"]
