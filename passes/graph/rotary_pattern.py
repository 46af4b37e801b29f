"""Rotary position embedding written out in ATen ops (Hugging Face Llama / Mistral / Qwen2's
`apply_rotary_pos_emb` on q and on k, rotate_half convention), forward and backward, found in a
joint graph and replaced by fxspeed::rotary_fwd / _bwd (runtime/kernels/rotary.py).

The forms are exactly the ones AOT export records for `x * cos + rotate_half(x) * sin` (torch
2.13, transformers 5; x = q or k [B, H, S, D], cos/sin [1 or B, 1, S, D]; h = D/2, INT_MAX is
sys.maxsize, `slice(t, -1, a, b)` is aten.slice.Tensor on the last dim, given as -1 or its index):

    before (forward)                             after
      a  = mul(x, cos)                              out' = fxspeed.rotary_fwd(x, cos, sin)
      x1 = slice(x, -1, 0, h)
      x2 = slice(x, -1, h, INT_MAX or D)
      n  = neg(x2)
      r  = cat([n, x1], -1)
      b  = mul(r, sin)
      out = add(a, b)

    before (backward: x's gradient for the gradient g of out; autograd's sum of the gradients of
    the three readers of x)
      gs = mul(g, sin)                               dx' = fxspeed.rotary_bwd(g, cos, sin)
      p  = slice(gs, -1, 0, h); q = slice(gs, -1, h, D or INT_MAX)
      np = neg(p)
      u  = slice_backward(np, shape, -1, h, INT_MAX or D, 1)
      v  = slice_backward(q, shape, -1, 0, h, 1)
      w  = add(u, v)
      gc = mul(g, cos)
      dx = add(w, gc)

Muls and adds are matched in either operand order (IEEE multiplication and addition commute
exactly). Forward and backward are matched and rewritten independently: the backward reads only
g, cos and sin, no value of the forward (rotary is linear in x), so there is nothing that would tie
a backward to its forward in the graph (q's and k's share cos/sin, and their shapes are equal when
there are as many kv heads as heads), and each rewrite is exact alone. A checkpointed layer's first
forward (no backward) and its recomputed copy in backward are fused like any other.

Casts folded into the rotary ("rotary promotes to fp32"): in a bf16/fp16 program q and k come out of
the low matmul low (keep_activations_low), but cos/sin are fp32 (capture runs in fp32, so HF's
`cos.to(x.dtype)` is a no-op there), so the region runs in fp32 and a cast back to low follows before
attention. When the rotary's result is read only by such a cast, directly or through a chain of
single-reader layout ops (views, transpose, clone, and a cat with empty 1-D tensors, which cat skips:
the k of HF's DynamicCache, `cat([empty, k], -2)`, captured when use_cache is on), the fused op
writes the low dtype directly and the chain is rebuilt in it:

    before:  out = add(a, b) [fp32]; c = _to_copy(out, dtype=bf16)
    after:   c' = fxspeed.rotary_fwd(x, cos, sin, bf16)                  (x read in bf16 as before)

    before:  k = add(a, b); kc = cat([e, k], -2); c = _to_copy(kc, dtype=bf16)
    after:   k' = fxspeed.rotary_fwd(x, cos, sin, bf16); c' = cat([_to_copy(e, dtype=bf16), k'], -2)

    before:  dx = add(w, gc); t = transpose(dx, 1, 2); cl = clone(t); vw = _unsafe_view(cl, [B, S, HD])
             c = _to_copy(vw, dtype=bf16)
    after:   dx' = fxspeed.rotary_bwd(g, cos, sin, bf16); t' = transpose(dx', 1, 2); cl' = clone(t')
             c' = _unsafe_view(cl', [B, S, HD])

Values: bit-identical. The fused ops compute the matched nodes' operations in fp32 in the same
order, each rounded once as ATen rounds it (an fp32 product or sum; the bf16/fp16 operands' upcasts
are exact), and round the result to the low dtype once, as the cast did; layout ops move values and
the empty operands of a cat add none. Backward only: a zero may come out with the other sign (the
unfused graph adds slice_backward's +0 fill). This is what eager autocast computes too: ATen's bf16
mul/add upcast, compute in fp32 and round once per op.

Exact forms only; checked on every node: shapes (x [..., D] with D even, every half [..., D/2],
every product, sum and gradient x's shape, cos/sin broadcasting to it), dtypes (the products and sums
fp32, x / g, cos and sin fp32, bf16 or fp16: so the region computes in fp32 as the fused op does),
and readers (each intermediate read only by the next node of the region). Left alone: a split other
than D/2 (or interleaved / GPT-J style rotary), the cat's operands swapped (the other rotation
direction), an intermediate read outside the region, a region computed in bf16/fp16 (its rounding
differs from the fused op's fp32), x's gradient summed in another order or together with another
reader's gradient (rotate_half(x) evaluated before x * cos gives (g cos + u) + v: its forward fuses,
its backward not, since that sum's layout is g's, not the fused op's contiguous one), and any
rewrite whose result would not have the matched node's shape, dtype and strides (the check is made
on the new nodes' fake values; the graph is then left as it was). Partial rotary (rotary on a slice of
the head dim) fuses when its rotated part has these forms: x is then the slice.

Layout: the fused forward's result has x's strides and the backward's is contiguous, as the matched
adds' results have in every capture (the first operand of `add` decides its layout).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.fx as fx

from fxspeed.compiler.rewrite import VIEW_LIKE, call, fake_value
from fxspeed.passes.memory.recompute_checkpointed import CASTS

from .insert_casts import LOW_DTYPES
from .pattern_match import (inherit_meta, is_call, is_like, mul_operand, other_operand, rewrite_each, tensor_value,
                            users_of)

aten = torch.ops.aten
prims = torch.ops.prims

_MATH = torch.float32  # the matched products and sums: fp32, what the fused ops compute in
_OPERANDS = (torch.float32, torch.bfloat16, torch.float16)  # x / g, cos, sin (exact upcasts to fp32)
_LOW = frozenset(LOW_DTYPES.values())
_LAYOUT_OPS = frozenset(VIEW_LIKE | {aten.clone.default})  # a cast commutes with them exactly


@dataclass
class FoldedCast:
    """The cast to `dtype` that reads the rotary's result through `chain` (layout ops, in order)."""

    dtype: torch.dtype
    chain: list[fx.Node]
    cast: fx.Node


@dataclass
class RotaryMatch:
    """One rotary region: forward (x = q or k) or backward (x = the gradient of its result)."""

    backward: bool
    x: fx.Node
    cos: fx.Node
    sin: fx.Node
    out: fx.Node  # the final add: replaced by the fused op (or, folded, the cast by the chain's end)
    nodes: list[fx.Node] = field(default_factory=list)  # the region, erased when dead
    fold: Optional[FoldedCast] = None


# --- small structural predicates ----------------------------------------------------------------

def _ints(*vs: Any) -> bool:
    return all(type(v) is int for v in vs)


def _last(dim: Any, nd: int) -> bool:
    return _ints(dim) and dim in (-1, nd - 1)


def _bounds(start: Any, end: Any, size: int) -> Optional[tuple[int, int]]:
    """(start, end) of a slice of a dim of `size`, end clamped as slicing clamps it; None for
    negative or non-integer bounds (never captured)."""
    start = 0 if start is None else start
    end = sys.maxsize if end is None else end
    if not _ints(start, end) or start < 0 or end < 0:
        return None
    return start, min(end, size)


def _half(n: Any, src: fx.Node, first: bool) -> bool:
    """n = slice.Tensor(src, last dim, 0, D/2) (first) or (src, last dim, D/2, D or more), step 1."""
    if not (isinstance(n, fx.Node) and n.op == "call_function" and n.target is aten.slice.Tensor and not n.kwargs
            and 2 <= len(n.args) <= 5 and n.args[0] is src):
        return False
    dim, start, end, step = (*n.args[1:], *(0, None, None, 1)[len(n.args) - 1:])
    v = tensor_value(src)
    d = v.shape[-1]
    want = (0, d // 2) if first else (d // 2, d)
    return _last(dim, v.dim()) and step == 1 and _bounds(start, end, d) == want


def _half_back(n: Any, grad: fx.Node, shape: tuple, first: bool) -> bool:
    """n = slice_backward(grad, shape, last dim, bounds of the first / second half, 1)."""
    if not (is_call(n, aten.slice_backward.default, 6) and n.args[0] is grad):
        return False
    _, sizes, dim, start, end, step = n.args
    d = shape[-1]
    want = (0, d // 2) if first else (d // 2, d)
    return (list(sizes) == list(shape) and _last(dim, len(shape)) and step == 1
            and _bounds(start, end, d) == want)


def _add_of(n: Any, a: fx.Node) -> Optional[fx.Node]:
    """For n = add.Tensor(a, b) or (b, a) with a tensor b other than a: b."""
    b = other_operand(n, aten.add.Tensor, a)
    return b if b is not a else None


def _only_user(n: fx.Node) -> Optional[fx.Node]:
    return next(iter(n.users)) if len(n.users) == 1 else None


def _operand(n: Any, shape: tuple) -> bool:
    """cos / sin: a tensor of an fp32-exact dtype broadcasting to `shape` (without growing it)."""
    v = tensor_value(n)
    return (v is not None and v.dtype in _OPERANDS and v.dim() <= len(shape)
            and all(s in (1, t) for s, t in zip(reversed(v.shape), reversed(shape))))


def _checked(x: fx.Node, cos: fx.Node, sin: fx.Node, full: list[fx.Node], halves: list[fx.Node],
             half_dtype: Optional[torch.dtype], same: list[fx.Node]) -> bool:
    """Shapes and dtypes of a region: `full` fp32 nodes of x's shape, `same` nodes of x's shape and
    dtype, `halves` of shape [..., D/2] and `half_dtype` (None: x's); x, cos and sin operands the
    fused op takes."""
    xv = tensor_value(x)
    if xv is None or xv.dtype not in _OPERANDS or xv.dim() < 1 or xv.shape[-1] < 2 or xv.shape[-1] % 2:
        return False
    shape, dt = tuple(xv.shape), xv.dtype
    half = (*shape[:-1], shape[-1] // 2)
    return (_operand(cos, shape) and _operand(sin, shape) and all(is_like(n, shape, _MATH) for n in full)
            and all(is_like(n, half, half_dtype or dt) for n in halves) and all(is_like(n, shape, dt) for n in same))


# --- forward ------------------------------------------------------------------------------------

def match_forward(n: fx.Node) -> Optional[RotaryMatch]:
    """The forward rotary whose neg is n (see the module docstring), or None."""
    if not is_call(n, aten.neg.default, 1) or not isinstance(x2 := n.args[0], fx.Node):
        return None
    x = x2.args[0] if x2.op == "call_function" and x2.args else None
    if not isinstance(x, fx.Node) or tensor_value(x) is None or not _half(x2, x, first=False):
        return None
    r = _only_user(n)
    if not (is_call(r, aten.cat.default, 2) and isinstance(r.args[0], (list, tuple)) and len(r.args[0]) == 2
            and r.args[0][0] is n and _last(r.args[1], tensor_value(x).dim())):
        return None
    x1 = r.args[0][1]
    if not _half(x1, x, first=True) or users_of(x1) != {r} or users_of(x2) != {n}:
        return None
    b = _only_user(r)
    sin = mul_operand(b, r)
    out = _only_user(b) if sin is not None else None
    a = _add_of(out, b)
    cos = mul_operand(a, x)
    if cos is None or users_of(a) != {out}:
        return None
    region = [x1, x2, n, r, a, b, out]
    if cos in region or sin in region or not _checked(x, cos, sin, [a, b, out], [x1, x2, n], None, [r]):
        return None
    return RotaryMatch(backward=False, x=x, cos=cos, sin=sin, out=out, nodes=region, fold=_folded_cast(out))


# --- backward -----------------------------------------------------------------------------------

def match_backward(n: fx.Node) -> Optional[RotaryMatch]:
    """The backward rotary (x's gradient) whose neg is n (see the module docstring), or None."""
    if not is_call(n, aten.neg.default, 1) or not isinstance(p := n.args[0], fx.Node):
        return None
    gs = p.args[0] if p.op == "call_function" and p.args else None
    if not is_call(gs, aten.mul.Tensor, 2) or tensor_value(gs) is None or not _half(p, gs, first=True) or users_of(p) != {n}:
        return None
    shape = tuple(tensor_value(gs).shape)
    q = next((u for u in gs.users if u is not p), None)
    if users_of(gs) != {p, q} or not _half(q, gs, first=False):
        return None
    u, v = _only_user(n), _only_user(q)
    if not (_half_back(u, n, shape, first=False) and _half_back(v, q, shape, first=True)):
        return None
    w = _only_user(u)
    if _add_of(w, u) is not v or users_of(v) != {w}:
        return None
    dx = _only_user(w)
    gc = _add_of(dx, w)
    if gc is None or not is_call(gc, aten.mul.Tensor, 2) or users_of(gc) != {dx}:
        return None
    # g: the operand the two muls share (of the gradient's shape); sin and cos: their others
    g = next((t for t in gs.args if isinstance(t, fx.Node) and t in gc.args and tensor_value(t) is not None
              and tuple(tensor_value(t).shape) == shape), None)
    sin, cos = (mul_operand(gs, g), mul_operand(gc, g)) if g is not None else (None, None)
    region = [gs, p, q, n, u, v, w, gc, dx]
    if sin is None or cos is None or cos in region or sin in region:
        return None
    if not _checked(g, cos, sin, [gs, u, v, w, gc, dx], [p, q, n], _MATH, []):
        return None
    return RotaryMatch(backward=True, x=g, cos=cos, sin=sin, out=dx, nodes=region, fold=_folded_cast(dx))


# --- the cast after it --------------------------------------------------------------------------

def _cast_dtype(c: fx.Node, src: fx.Node) -> Optional[torch.dtype]:
    """The low dtype when c is a plain cast of src (no device, layout or memory-format change)."""
    if c.op != "call_function" or c.target not in CASTS:
        return None
    if c.target is aten._to_copy.default and c.args == (src,) and set(c.kwargs) == {"dtype"}:
        low = c.kwargs["dtype"]
    elif c.target is prims.convert_element_type.default and len(c.args) == 2 and c.args[0] is src and not c.kwargs:
        low = c.args[1]
    else:
        return None
    return low if low in _LOW and tensor_value(c) is not None and tensor_value(c).dtype == low else None


def _skipped_by_cat(t: Any) -> bool:
    """A 1-D empty tensor: torch.cat leaves it out (HF's empty DynamicCache layer)."""
    v = tensor_value(t)
    return v is not None and v.dim() == 1 and v.numel() == 0 and v.is_floating_point()


def _passes_through(u: fx.Node, src: fx.Node) -> bool:
    """u moves src's values only (a view, transpose, clone, or a cat with nothing else), in fp32."""
    if u.op != "call_function" or tensor_value(u) is None or tensor_value(u).dtype != _MATH:
        return False
    if u.target is aten.cat.default:
        ts = u.args[0]
        return (len(u.args) in (1, 2) and not u.kwargs and isinstance(ts, (list, tuple))
                and sum(t is src for t in ts) == 1 and all(t is src or _skipped_by_cat(t) for t in ts))
    kwargs_ok = set(u.kwargs) <= {"memory_format"} if u.target is aten.clone.default else not u.kwargs
    return (u.target in _LAYOUT_OPS and kwargs_ok and bool(u.args) and u.args[0] is src
            and u.all_input_nodes == [src])


def _folded_cast(out: fx.Node) -> Optional[FoldedCast]:
    """The cast to bf16/fp16 that is the only reader of out (through single-reader layout ops)."""
    chain: list[fx.Node] = []
    src = out
    while (u := _only_user(src)) is not None:
        low = _cast_dtype(u, src)
        if low is not None:
            return FoldedCast(dtype=low, chain=chain, cast=u)
        if not _passes_through(u, src):
            return None
        chain.append(u)
        src = u
    return None


# --- find and rewrite ---------------------------------------------------------------------------

def match_at(n: fx.Node) -> Optional[RotaryMatch]:
    """The rotary region (forward or backward) whose neg is n, or None."""
    return match_forward(n) or match_backward(n)


def find_rotaries(graph: fx.Graph) -> list[RotaryMatch]:
    """Every rotary region of `graph` as it is now (one per neg anchoring an exact form)."""
    return [mt for n in graph.nodes if n.op == "call_function" and n.target is aten.neg.default
            if (mt := match_at(n)) is not None]


def fuse_rotary(graph: fx.Graph, module_of: dict[str, str]) -> int:
    """Rewrite every rotary region of `graph`; the number rewritten (a forward and its backward are
    two regions: they are matched independently)."""
    import fxspeed.runtime.kernels.rotary  # noqa: F401  registers the fxspeed:: ops (triton is not imported)

    return rewrite_each(graph, aten.neg.default, match_at, rewrite, module_of)


def _same_layout(new: fx.Node, old: fx.Node) -> bool:
    """Same shape, dtype and strides (those of size-1 dims aside: no index reads them)."""
    a, b = tensor_value(new), tensor_value(old)
    return (a is not None and b is not None and a.shape == b.shape and a.dtype == b.dtype and a.device == b.device
            and all(s == t for s, t, k in zip(a.stride(), b.stride(), a.shape) if k > 1))


def _node(graph: fx.Graph, target: Any, args: tuple, kwargs: Optional[dict] = None) -> fx.Node:
    """`call`, with the fake value computed first: a layout op that cannot take the new value
    (a view of a tensor whose strides forbid it) raises before any node is made."""
    fake_value(target, args, kwargs)
    return call(graph, target, args, kwargs)


def rewrite(graph: fx.Graph, mt: RotaryMatch, module_of: dict[str, str]) -> bool:
    """Replace one matched region by the fused op (and its cast, see the module docstring). Returns
    False, leaving the graph as it was, when the new nodes' shapes, dtypes or strides differ from
    the nodes they replace."""
    op = torch.ops.fxspeed.rotary_bwd.default if mt.backward else torch.ops.fxspeed.rotary_fwd.default
    fold = mt.fold
    made: list[fx.Node] = []
    pairs: list[tuple[fx.Node, fx.Node]] = []  # (new, the node whose meta and module it takes)
    try:
        with graph.inserting_before(mt.out):
            fused = _node(graph, op, (mt.x, mt.cos, mt.sin, *((fold.dtype,) if fold else ())))
        made.append(fused)
        pairs.append((fused, mt.out))
        last, src = fused, mt.out
        for old in fold.chain if fold else ():
            with graph.inserting_before(old):
                if old.target is aten.cat.default:
                    ts = []
                    for t in old.args[0]:
                        if t is src:
                            ts.append(last)
                            continue
                        empty = _node(graph, aten._to_copy.default, (t,), {"dtype": fold.dtype})  # 0 bytes
                        made.append(empty)
                        pairs.append((empty, old))
                        ts.append(empty)
                    args = (ts, *old.args[1:])
                else:
                    args = (last, *old.args[1:])
                new = _node(graph, old.target, args, dict(old.kwargs))
            made.append(new)
            pairs.append((new, old))
            last, src = new, old
        ok = _same_layout(last, fold.cast if fold else mt.out)
    except (RuntimeError, ValueError):  # the fake op refused the new operands: not this form
        ok = False
    if not ok:
        for m in reversed(made):
            graph.erase_node(m)
        return False
    for new, old in pairs:
        inherit_meta(new, old, module_of)
        if tensor_value(new).dtype != tensor_value(old).dtype:  # folded: the old node's recorded tensor metadata is not this one's
            new.meta.pop("tensor_meta", None)
    (fold.cast if fold else mt.out).replace_all_uses_with(last)
    order = {m: i for i, m in enumerate(graph.nodes)}
    dead = [fold.cast, *fold.chain] if fold else []
    for m in sorted([*dead, *mt.nodes], key=order.__getitem__, reverse=True):  # readers first
        if not m.users:
            graph.erase_node(m)
    return True


__all__ = ["FoldedCast", "RotaryMatch", "find_rotaries", "fuse_rotary", "match_at", "match_backward",
           "match_forward", "rewrite"]
