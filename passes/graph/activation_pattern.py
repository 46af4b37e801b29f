"""Activations of transformer MLPs, forward and backward, found in a joint graph and replaced by
fxspeed::swiglu_fwd / _bwd and fxspeed::gelu_fwd / _bwd (runtime/kernels/activations.py).

`fuse_activations` is called by fuse_kernels, before recompute_pointwise; the forms are exactly
the ones AOT export records at that point (torch 2.13, transformers 5). Three kinds:

1. SwiGLU (HF Llama / Mistral / Qwen2 `down(silu(gate(x)) * up(x))`). `silu_backward` is a
   composite op: its ATen formula `dsu * (sig * (1 + g * (1 - sig)))` is what the graph holds,
   its `1 - sig` written `sub(fill(empty_like(sig), 1), sig)`:

    before (forward)              before (backward)
      s = silu(g)                   gu = mul(dy, s)                     (up's gradient)
      y = mul(s, u)                 dsu = mul(dy, u)                    (s's gradient)
                                    sig = sigmoid(g); e = empty_like(sig or to_fp32(sig))
                                    one = fill(e, 1); d = sub(one, sig); k = mul(g, d)
                                    a = add.Scalar(k, 1); ds = mul(sig, a)
                                    gg = mul(dsu, ds)                   (gate's gradient)
                                    [or gg = silu_backward(dsu, g)]
    after
      y' = fxspeed.swiglu_fwd(g, u)
      b = fxspeed.swiglu_bwd(dy, g, u); gg' = b[0]; gu' = b[1]

   so backward keeps g and u, not s as well, and reads them once.

2. GELU, tanh form written out (HF's NewGELUActivation, "gelu_new": GPT-2, Phi, GPT-J), with
   k = sqrt(2/pi) and c = 0.044715 exactly:

    before (forward)              before (backward)
      h = mul(x, 0.5)               m6 = mul(dy, h); m7 = mul(dy, o)
      p = pow(x, 3)                 tb = tanh_backward(m6, t); m8 = mul(tb, k)
      a = add(x, mul(p, c))         m11 = mul(mul(m8, c), mul.Scalar(pow(x, 2), 3))
      t = tanh(mul(a, k))           dx = add(add(m8, m11), mul(m7, 0.5))
      o = add(t, 1.0)
      y = mul(h, o)
    after
      y' = fxspeed.gelu_fwd(x, "tanh");  dx' = fxspeed.gelu_bwd(dy, x, "tanh")

   and aten.gelu / aten.gelu_backward (F.gelu, fxspeed.models.GPT, BERT, GPT-NeoX, Falcon), one
   for one: gelu(x, ap) -> gelu_fwd(x, ap); gelu_backward(dy, x, ap) -> gelu_bwd(dy, x, ap).

3. A bias added by a node of its own before a GELU (HF Falcon with bias=True: FalconLinear is
   `x @ w.T + b`, not addmm; every other model looked at, Linear or Conv1D, has the bias inside
   addmm), folded into the fused ops:

    before:  z = add(h, b); y = gelu(z); ... dz = gelu_backward(dy, z)   (b: [N], h: [..., N])
    after:   y' = fxspeed.gelu_fwd(h, ap, b); ... dz' = fxspeed.gelu_bwd(dy, h, ap, b)

   when z is read by nothing else (backward keeps h instead of z; the bias gradient, a sum of dz,
   stays as it was). No capture has a bias add before silu or SwiGLU, so none is folded there.

Forward and backward are matched as one region. A region with no backward (inference, a
checkpointed layer's first forward: nothing outside the forward reads its values) is fused as a
forward alone; one whose forward product is not in the graph (a checkpointed layer's
recomputation in bf16, which recomputes silu(g) / tanh for backward but not the product: the down
projection's weight gradient reads the first forward's bf16 copy) as a backward alone. There the
recomputed up projection can come after the backward's first node; the few pure ops that make it
are moved up to the fused backward (`_hoist`), nothing else is reordered.

Casts (bf16/fp16 programs, after insert_casts and keep_activations_low): a region may read x, g,
u, dy in the low dtype, some of its reads through `_to_copy(x, dtype=fp32)` (exact upcasts, read
through: the fused op reads x), and compute parts in fp32, e.g. GPT-2's `add(x16, mul(p32, c))`.
The fused ops compute everything in fp32 and write each output in the matched node's dtype; when
every reader of an output is the same cast to a lower dtype, the op writes that dtype and the cast
goes (the fp32 result rounded once, what the cast did):

    before:  gg = mul(dsu, ds) [fp32]; c = _to_copy(gg, dtype=bf16)
    after:   b = fxspeed.swiglu_bwd(dy, g, u, bf16, bf16); c -> b[0]

Values: fp32 regions agree with the unfused ops to rounding. Low-precision regions differ from
them by the roundings the unfused ops make to bf16/fp16 between steps (e.g. Llama's bf16
silu(g) before the product) which the fused ops do not make: one rounding of the fp32 result,
what eager autocast's fused ATen kernels give (silu_backward, gelu_backward on low tensors).

Exact forms only, checked on every node: its op, constants, operand structure (muls and adds in
either operand order: they commute exactly), shape (every value of the region x's shape: no
broadcasting), dtype (fp32, bf16 or fp16) and readers (each intermediate read only by the next
nodes of the region; nothing outside reads silu(g), tanh, 0.5 x or 1 + tanh). Anything else is
left as it is: another constant or form of the tanh GELU (HF's FastGELU, Bloom's
`x * 0.5 * (1 + tanh(0.79788456 * x * (1 + 0.044715 * x * x)))`), CLIP's quick_gelu, SiLU
without its gating product (there is no fused op for it), an extra reader of s = silu(g), a
gradient sum that also accumulates another reader of x, a broadcast operand, a bias that is not
1-D over the last dim or whose sum z is read elsewhere, and any rewrite whose new nodes' fake
values would not have the replaced nodes' shapes and dtypes (the graph is then left as it was).
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.fx as fx

from fxspeed.compiler.rewrite import call, fake_value
from fxspeed.passes.memory.recompute_checkpointed import is_recomputable_op

from .pattern_match import inherit_meta, is_call, is_number, mul_operand, other_operand, tensor_value


aten = torch.ops.aten
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)  # the kernels' dtypes
_LOW = (torch.bfloat16, torch.float16)
SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)  # exactly HF's math.sqrt(2.0 / math.pi)
CUBIC = 0.044715


@dataclass
class ActivationMatch:
    """One matched activation: the fused forward and/or backward, and the nodes they replace."""

    kind: str  # "swiglu" | "gelu"
    forward_args: tuple  # swiglu: (g, u); gelu: (x, approximate, bias)
    out: Optional[fx.Node]  # replaced by the fused forward's output (None: backward only)
    backward_args: Optional[tuple] = None  # swiglu: (dy, g, u); gelu: (dy, x, approximate, bias)
    grads: list[fx.Node] = field(default_factory=list)  # swiglu: [gate's, up's]; gelu: [x's]
    first: Optional[fx.Node] = None  # earliest backward node reading dy (the fused backward goes before it)
    nodes: list[fx.Node] = field(default_factory=list)  # every node of the region, erased when dead


# --- small structural predicates ----------------------------------------------------------------

def _shaped(n: Any, shape: tuple) -> bool:
    """A node whose value has this shape and a kernel dtype."""
    v = tensor_value(n)
    return v is not None and tuple(v.shape) == shape and v.dtype in _FLOATS


def _scaled(n: Any, k: float, targets: tuple = (aten.mul.Tensor,)) -> Optional[fx.Node]:
    """For n = mul(a, k) with the number k: a."""
    if not any(is_call(n, t, 2) for t in targets) or not is_number(n.args[1], k) or not isinstance(n.args[0], fx.Node):
        return None
    return n.args[0]


def _upcast_of(n: Any) -> Optional[fx.Node]:
    """For n = _to_copy(x, dtype=fp32) with a bf16/fp16 x (an exact upcast): x."""
    if not (isinstance(n, fx.Node) and n.op == "call_function" and n.target is aten._to_copy.default
            and len(n.args) == 1 and n.kwargs == {"dtype": torch.float32}):
        return None
    x = n.args[0]
    v = tensor_value(x)
    return x if v is not None and v.dtype in _LOW else None


def _read(n: Any) -> Any:
    """The value a read stands for: x for an upcast of x, else n itself."""
    return _upcast_of(n) or n


def _only(n: fx.Node, *readers: fx.Node) -> bool:
    return set(n.users) == set(readers)


def _sole_user(n: fx.Node) -> Optional[fx.Node]:
    return next(iter(n.users)) if len(n.users) == 1 else None


class _Order:
    """Positions of the graph's nodes. Insertions and erasures leave the order of the other nodes
    as it was, so positions are recounted only when a node made since is asked about."""

    def __init__(self, graph: fx.Graph) -> None:
        self.graph = graph
        self._pos = self._count()

    def _count(self) -> dict[fx.Node, int]:
        return {m: i for i, m in enumerate(self.graph.nodes)}

    def __getitem__(self, n: fx.Node) -> int:
        if n not in self._pos:
            self.recount()
        return self._pos[n]

    def recount(self) -> None:
        """After nodes were moved."""
        self._pos = self._count()


def _earliest(nodes: list[fx.Node], order: _Order) -> fx.Node:
    return min(nodes, key=order.__getitem__)


# --- SwiGLU ----------------------------------------------------------------------------------------

def silu_grad_nodes(gg: fx.Node, dsu: fx.Node, g: fx.Node, shape: tuple) -> Optional[list[fx.Node]]:
    """The nodes of gg = dsu * silu'(g), ATen's composite silu_backward (or the op itself)."""
    if is_call(gg, aten.silu_backward.default, 2) and gg.args == (dsu, g):
        return [gg]
    ds = mul_operand(gg, dsu)
    if ds is None or not _only(ds, gg) or not is_call(ds, aten.mul.Tensor, 2):
        return None
    sig = next((a for a in ds.args if is_call(a, aten.sigmoid.default, 1) and a.args[0] is g), None)
    a = mul_operand(ds, sig) if sig is not None else None
    k = a.args[0] if (is_call(a, aten.add.Scalar, 2) or is_call(a, aten.add.Tensor, 2)) and is_number(a.args[1], 1) else None
    d = mul_operand(k, g) if isinstance(k, fx.Node) and _only(a, ds) and _only(k, a) else None
    if not (is_call(d, aten.sub.Tensor, 2) and d.args[1] is sig and _only(d, k)):
        return None
    one = d.args[0]
    if not (is_call(one, aten.fill.Scalar, 2) and is_number(one.args[1], 1) and _only(one, d)):
        return None
    e = one.args[0]
    if not (isinstance(e, fx.Node) and e.op == "call_function" and e.target is aten.empty_like.default
            and len(e.args) == 1 and set(e.kwargs.items()) <= {("memory_format", torch.preserve_format)}
            and _only(e, one)):
        return None
    src = e.args[0]
    up = [src] if src is not sig and _upcast_of(src) is sig and _only(src, e) else []
    if src is not sig and not up:
        return None
    nodes = [sig, *up, e, one, d, k, a, ds, gg]
    if not (_only(sig, up[0] if up else e, d, ds) and all(_shaped(m, shape) for m in nodes)):
        return None
    return nodes


def _swiglu_backward(g: fx.Node, s: fx.Node, y: Optional[fx.Node], gu: fx.Node, shape: tuple,
                     order: _Order) -> Optional[ActivationMatch]:
    """The region when gu = dy * s is the up projection's gradient and y = s * u the forward
    product (None: s is read by the backward alone, as in a checkpointed layer's recomputation
    whose product backward does not need)."""
    dy = mul_operand(gu, s)
    if dy is None or dy is g or not _shaped(dy, shape) or not _shaped(gu, shape):
        return None
    if y is not None:
        u = mul_operand(y, s)
        if u is None or not _shaped(y, shape):
            return None
        dsus = [w for w in u.users if w is not y and mul_operand(w, u) is dy]
    else:
        dsus = [w for w in dy.users if w is not gu and mul_operand(w, dy) not in (None, s)]
    found = []
    for dsu in dsus:  # dsu = dy * u, read only by silu's gradient
        u, gg = mul_operand(dsu, dy), _sole_user(dsu)
        grad = silu_grad_nodes(gg, dsu, g, shape) if gg is not None and u not in (g, dy) and _shaped(u, shape) else None
        if grad is not None and _shaped(dsu, shape):
            found.append(ActivationMatch(kind="swiglu", forward_args=(g, u), out=y, backward_args=(dy, g, u),
                                         grads=[gg, gu], first=_earliest([gu, dsu], order),
                                         nodes=[s, *([y] if y is not None else []), gu, dsu, *grad]))
    return found[0] if len(found) == 1 else None


def match_swiglu(s: fx.Node, order: Optional[_Order] = None) -> Optional[ActivationMatch]:
    """The SwiGLU whose silu is s (forward and backward, a forward without backward, or a
    backward whose forward product is not in the graph), or None."""
    if not is_call(s, aten.silu.default, 1):
        return None
    g = s.args[0]
    gv = tensor_value(g)
    if gv is None or gv.dtype not in _FLOATS or not _shaped(s, tuple(gv.shape)):
        return None
    shape = tuple(gv.shape)
    users = list(s.users)
    order = order or _Order(s.graph)
    if len(users) == 1:
        back = _swiglu_backward(g, s, None, users[0], shape, order)
        if back is not None:
            return back
        # no backward reads s: fused alone when nothing else computes silu's gradient from g
        y = users[0]
        u = mul_operand(y, s)
        if u is None or u is g or set(g.users) != {s} or not (_shaped(u, shape) and _shaped(y, shape)):
            return None
        return ActivationMatch(kind="swiglu", forward_args=(g, u), out=y, nodes=[s, y])
    if len(users) != 2:
        return None
    # y = s u and gu = dy s have one form (and u and dy are interchangeable in the backward's
    # too): the forward product is the one made first (dy depends on the loss, so on y)
    y, gu = sorted(users, key=order.__getitem__)
    return _swiglu_backward(g, s, y, gu, shape, order)


# --- GELU, tanh form written out ----------------------------------------------------------------------

def _forward_tanh_gelu(t: fx.Node) -> Optional[tuple[fx.Node, fx.Node, fx.Node, Optional[fx.Node], list[fx.Node]]]:
    """(x, h, o, y, forward nodes) for the forward around tanh t; y is None when the product
    h * o is not in the graph (a checkpointed layer's recomputation for backward: h is then
    found as the operand of tanh's backward)."""
    z = t.args[0] if is_call(t, aten.tanh.default, 1) else None
    a = _scaled(z, SQRT_2_OVER_PI) if z is not None and _only(z, t) else None
    if a is None or not _only(a, z) or not is_call(a, aten.add.Tensor, 2):
        return None
    for xr, c in (a.args, a.args[::-1]):
        p = _scaled(c, CUBIC)
        if p is not None and is_call(p, aten.pow.Tensor_Scalar, 2) and is_number(p.args[1], 3) and _only(c, a) \
                and _only(p, c) and isinstance(xr, fx.Node) and _read(p.args[0]) is _read(xr):
            break
    else:
        return None
    x = _read(xr)
    o = next((w for w in t.users if is_call(w, aten.add.Tensor, 2) and w.args[0] is t and is_number(w.args[1], 1)), None)
    if o is None:
        return None
    ys = [(w, h) for w in o.users if (h := mul_operand(w, o)) is not None and _read(_scaled(h, 0.5)) is x]
    if len(ys) == 1:
        y, h = ys[0]
    elif not ys and len(tbs := [w for w in t.users if is_call(w, aten.tanh_backward.default, 2)]) == 1:
        m6 = tbs[0].args[0]  # dy * h
        hs = [m for m in m6.args if _read(_scaled(m, 0.5)) is x] if is_call(m6, aten.mul.Tensor, 2) else []
        if len(hs) != 1:
            return None
        y, h = None, hs[0]
    else:
        return None
    reads = [m for m in dict.fromkeys((xr, p.args[0], h.args[0])) if m is not x]  # upcasts of x the region reads
    return x, h, o, y, [*reads, p, c, a, z, t, o, h, *([y] if y is not None else [])]


def _backward_tanh_gelu(x: fx.Node, t: fx.Node, h: fx.Node, o: fx.Node, y: Optional[fx.Node], order: _Order
                        ) -> Optional[tuple[fx.Node, fx.Node, fx.Node, list[fx.Node]]]:
    """(dy, dx, the first backward node, backward nodes): autograd's chain for y = h * o."""
    m6s, m7s = [w for w in h.users if w is not y], [w for w in o.users if w is not y]
    if len(m6s) != 1 or len(m7s) != 1:
        return None
    m6, m7 = m6s[0], m7s[0]
    dy = mul_operand(m6, h)
    if dy is None or mul_operand(m7, o) is not dy:
        return None
    tb = _sole_user(m6)
    if not (is_call(tb, aten.tanh_backward.default, 2) and tb.args == (m6, t) and _only(t, o, tb)):
        return None
    m8 = _sole_user(tb)
    if _scaled(m8, SQRT_2_OVER_PI) is not tb or len(m8.users) != 2:
        return None
    m9 = next((w for w in m8.users if _scaled(w, CUBIC) is m8), None)
    m11 = _sole_user(m9) if m9 is not None else None
    m10 = mul_operand(m11, m9) if m11 is not None else None
    pw = _scaled(m10, 3, (aten.mul.Tensor, aten.mul.Scalar)) if m10 is not None else None
    if not (pw is not None and is_call(pw, aten.pow.Tensor_Scalar, 2) and is_number(pw.args[1], 2) and _read(pw.args[0]) is x
            and _only(pw, m10) and _only(m10, m11)):
        return None
    a7 = _sole_user(m11)
    if a7 is None or other_operand(a7, aten.add.Tensor, m8) is not m11 or not _only(m8, m9, a7):
        return None
    m12 = _sole_user(m7)
    if _scaled(m12, 0.5) is not m7:
        return None
    dx = _sole_user(a7)
    if dx is None or other_operand(dx, aten.add.Tensor, a7) is not m12 or not _only(m12, dx):
        return None
    reads = [pw.args[0]] if pw.args[0] is not x else []
    return dy, dx, _earliest([m6, m7], order), [m6, m7, tb, m8, m9, *reads, pw, m10, m11, a7, m12, dx]


def match_tanh_gelu(t: fx.Node, order: Optional[_Order] = None) -> Optional[ActivationMatch]:
    """The written-out tanh GELU around tanh t (forward and backward, a forward without backward,
    or a backward whose forward product is not in the graph), or None."""
    fwd = _forward_tanh_gelu(t)
    if fwd is None:
        return None
    x, h, o, y, forward = fwd
    xv = tensor_value(x)
    if xv is None or xv.dtype not in _FLOATS:
        return None
    shape = tuple(xv.shape)
    if y is not None and _only(t, o) and _only(o, y) and _only(h, y):  # nothing in backward reads the forward
        back = None
    else:
        back = _backward_tanh_gelu(x, t, h, o, y, order or _Order(t.graph))
        if back is None:
            return None
    nodes = forward + (back[3] if back else [])
    if not all(_shaped(m, shape) for m in nodes) or (back is not None and not _shaped(back[0], shape)):
        return None
    mt = ActivationMatch(kind="gelu", forward_args=(x, "tanh", None), out=y, nodes=nodes)
    if back is not None:
        dy, dx, first, _ = back
        mt.backward_args, mt.grads, mt.first = (dy, x, "tanh", None), [dx], first
    return _with_bias(mt)


# --- aten.gelu, and a bias add before a GELU -----------------------------------------------------------

def _approximate(n: fx.Node, nargs: int) -> Optional[str]:
    """gelu(x, approximate) / gelu_backward(dy, x, approximate): the approximation, or None."""
    if len(n.args) == nargs:
        ap = n.kwargs.get("approximate", "none")
        extra = set(n.kwargs) - {"approximate"}
    elif len(n.args) == nargs + 1:
        ap, extra = n.args[nargs], set(n.kwargs)
    else:
        return None
    return ap if ap in ("none", "tanh") and not extra else None


def _gelu_backward(n: fx.Node, x: fx.Node, ap: str) -> bool:
    """n = aten.gelu_backward(dy, x, ap) with dy and n of x's shape."""
    shape = tuple(tensor_value(x).shape)
    return (n.op == "call_function" and n.target is aten.gelu_backward.default and n.args[1] is x
            and _approximate(n, 2) == ap and _shaped(n, shape) and _shaped(n.args[0], shape))


def match_aten_gelu(q: fx.Node, order: Optional[_Order] = None) -> Optional[ActivationMatch]:
    """q = aten.gelu(x) with its aten.gelu_backward(dy, x) when x has one (swapped one for one;
    a bias add before it folded in)."""
    if not (q.op == "call_function" and q.target is aten.gelu.default and q.args and isinstance(q.args[0], fx.Node)):
        return None
    ap, x = _approximate(q, 1), q.args[0]
    xv = tensor_value(x)
    if ap is None or xv is None or xv.dtype not in _FLOATS or not _shaped(q, tuple(xv.shape)):
        return None
    mt = ActivationMatch(kind="gelu", forward_args=(x, ap, None), out=q, nodes=[q])
    twins = [w for w in x.users if w is not q and w.target is aten.gelu.default and _approximate(w, 1) == ap]
    bwds = [w for w in x.users if _gelu_backward(w, x, ap)]
    if len(bwds) == 1 and not twins:  # the pair: one gelu of x, one backward (else each alone)
        b = bwds[0]
        mt.backward_args, mt.grads, mt.first, mt.nodes = (b.args[0], x, ap, None), [b], b, [q, b]
    return _with_bias(mt)


def match_gelu_backward(b: fx.Node) -> Optional[ActivationMatch]:
    """An aten.gelu_backward left by match_aten_gelu (its forward not fused with it), alone."""
    if not (b.op == "call_function" and b.target is aten.gelu_backward.default and len(b.args) >= 2
            and isinstance(b.args[1], fx.Node)):
        return None
    x, ap = b.args[1], _approximate(b, 2)
    if ap is None or tensor_value(x) is None or tensor_value(x).dtype not in _FLOATS or not _gelu_backward(b, x, ap):
        return None
    return _with_bias(ActivationMatch(kind="gelu", forward_args=(x, ap, None), out=None,
                                      backward_args=(b.args[0], x, ap, None), grads=[b], first=b, nodes=[b]))


def _with_bias(mt: ActivationMatch) -> ActivationMatch:
    """`mt` with a bias add before it folded in: x = add(h, b), b 1-D over x's last dim, h of x's
    shape, x read only by the region (so the fused ops read h and b, and x is gone)."""
    x = mt.forward_args[0]
    if not is_call(x, aten.add.Tensor, 2) or not set(x.users) <= set(mt.nodes):
        return mt
    xv = tensor_value(x)
    for h, b in (x.args, x.args[::-1]):  # h + b or b + h: addition commutes exactly
        hv, bv = tensor_value(h), tensor_value(b)
        if (hv is not None and bv is not None and bv.dtype in _FLOATS and _shaped(h, tuple(xv.shape))
                and bv.dim() == 1 and xv.dim() >= 1 and bv.shape[0] == xv.shape[-1] and h is not b):
            break
    else:
        return mt
    ap = mt.forward_args[1]
    mt.forward_args = (h, ap, b)
    if mt.backward_args is not None:
        mt.backward_args = (mt.backward_args[0], h, ap, b)
    mt.nodes = [x, *mt.nodes]
    return mt


# --- all of them --------------------------------------------------------------------------------------

_ANCHORS = {aten.silu.default: match_swiglu, aten.tanh.default: match_tanh_gelu, aten.gelu.default: match_aten_gelu}


def match_at(n: fx.Node, order: Optional[_Order] = None) -> Optional[ActivationMatch]:
    """The activation anchored at n (a silu, tanh or gelu node), or None. `order`: the graph's
    node positions, counted once for many calls."""
    m = _ANCHORS.get(n.target) if n.op == "call_function" else None
    return m(n, order) if m is not None else None


def find_activations(graph: fx.Graph) -> list[ActivationMatch]:
    """Every activation of `graph` as it is now (`fuse_activations` matches each again just
    before rewriting it: a rewrite can replace another region's inputs, as in gelu(gelu(x)))."""
    order = _Order(graph)
    return [mt for n in graph.nodes if (mt := match_at(n, order)) is not None]


def fuse_activations(graph: fx.Graph, module_of: dict[str, str]) -> int:
    """Rewrite every matched activation of `graph` (the module docstring's forms); the number of
    regions rewritten: a SwiGLU or GELU with its backward counts one, as does a forward alone, a
    backward alone and an aten.gelu_backward swapped alone. Run it after the norms' rewrites of
    fuse_kernels and before recompute_pointwise (which would clone these forms into backward)."""
    order = _Order(graph)
    count = 0
    anchors = [n for n in graph.nodes if n.op == "call_function" and n.target in _ANCHORS]
    for n in anchors:
        if getattr(n, "_erased", False):
            continue
        mt = match_at(n, order)
        if mt is not None and rewrite(graph, mt, module_of, order):
            count += 1
    for b in [n for n in graph.nodes if n.op == "call_function" and n.target is aten.gelu_backward.default]:
        mt = match_gelu_backward(b)
        if mt is not None and rewrite(graph, mt, module_of, order):
            count += 1
    return count


# --- the rewrite -------------------------------------------------------------------------------------

def _is_cast(n: fx.Node, src: fx.Node) -> Optional[torch.dtype]:
    """The dtype of n = _to_copy(src, dtype=D), else None."""
    if (n.op == "call_function" and n.target is aten._to_copy.default and n.args == (src,)
            and set(n.kwargs) == {"dtype"} and n.kwargs["dtype"] in _FLOATS):
        return n.kwargs["dtype"]
    return None


def _written(old: fx.Node) -> tuple[torch.dtype, list[fx.Node]]:
    """(the dtype the fused op writes for old's value, the nodes that value replaces): old's own,
    or, when every reader of old is the same cast, the cast's dtype and the casts."""
    dtypes = {_is_cast(u, old) for u in old.users}
    if old.users and len(dtypes) == 1 and None not in dtypes:
        return dtypes.pop(), list(old.users)
    return tensor_value(old).dtype, [old]


def _ops(kind: str) -> tuple[Any, Any]:
    import fxspeed.runtime.kernels.activations  # noqa: F401  registers the fxspeed:: ops (triton is not imported)

    ops = torch.ops.fxspeed
    if kind == "swiglu":
        return ops.swiglu_fwd.default, ops.swiglu_bwd.default
    return ops.gelu_fwd.default, ops.gelu_bwd.default


def _fits(value: Any, old: fx.Node) -> bool:
    """A fused op's fake value has the shape and dtype of the node it replaces."""
    v = tensor_value(old)
    return isinstance(value, torch.Tensor) and v is not None and value.shape == v.shape and value.dtype == v.dtype


_HOIST_LIMIT = 16  # nodes moved up for one backward; more is not a form seen in a capture


def _hoistable(late: list[fx.Node], before: fx.Node, order: _Order) -> Optional[list[fx.Node]]:
    """The nodes to move to just before `before` so that the nodes `late` (made after it) are made
    before it: they and the inputs of theirs also made after it, in graph order; None when one is
    not a pure deterministic op (so moving it changes only when it runs) or `before` is one."""
    moved: set[fx.Node] = set()
    todo = list(late)
    while todo:
        n = todo.pop()
        if n in moved:
            continue
        if n is before or n.op != "call_function" or not is_recomputable_op(n) or len(moved) >= _HOIST_LIMIT:
            return None
        moved.add(n)
        todo += [a for a in n.all_input_nodes if order[a] > order[before]]
    return sorted(moved, key=order.__getitem__)


def rewrite(graph: fx.Graph, mt: ActivationMatch, module_of: dict[str, str], order: Optional[_Order] = None) -> bool:
    """Replace one matched activation by the fused ops (the module docstring's before/after).

    The fused backward goes before the region's first backward node; inputs of it made later (a
    checkpointed layer's recomputed up projection) are moved up to it with the pure ops that make
    them. Returns False, leaving the graph as it was, when a fused op's shapes/dtypes would differ
    from the nodes it replaces or its inputs cannot be made before its place."""
    order = order or _Order(graph)
    fwd_op, bwd_op = _ops(mt.kind)
    backward = mt.backward_args is not None
    fwd_args = bwd_args = None
    pairs: list[tuple[Any, fx.Node]] = []  # (output index or None, the node its value replaces)
    if mt.out is not None:
        dtype, olds = _written(mt.out)
        fwd_args = (*mt.forward_args, dtype)
        value = fake_value(fwd_op, fwd_args)
        if not all(_fits(value, old) for old in olds):
            return False
        pairs += [(None, old) for old in olds]
    hoist: list[fx.Node] = []
    if backward:
        written = [_written(gr) for gr in mt.grads]
        bwd_args = (*mt.backward_args, *(d for d, _ in written))
        values = fake_value(bwd_op, bwd_args)
        values = [values] if len(written) == 1 else list(values)
        if not all(_fits(v, old) for v, (_, olds) in zip(values, written) for old in olds):
            return False
        pairs += [(i, old) for i, (_, olds) in enumerate(written) for old in olds]
        late = [a for a in mt.backward_args if isinstance(a, fx.Node) and order[a] >= order[mt.first]]
        hoist = _hoistable(late, mt.first, order) if late else []
        if hoist is None:
            return False
    new: dict[Any, fx.Node] = {}  # None: the fused forward; i: the backward's output i
    if fwd_args is not None:
        with graph.inserting_before(mt.out):
            new[None] = call(graph, fwd_op, fwd_args)
        inherit_meta(new[None], mt.out, module_of)  # stack trace, module, checkpoint tags: as on the node it stands for
    if bwd_args is not None:
        for n in hoist:
            mt.first.prepend(n)
        if hoist:
            order.recount()
        with graph.inserting_before(mt.first):
            b = call(graph, bwd_op, bwd_args)
            outs = [b] if len(mt.grads) == 1 else [call(graph, operator.getitem, (b, i)) for i in range(len(mt.grads))]
        for node, like in ((b, mt.grads[0]), *zip(outs, mt.grads)):
            inherit_meta(node, like, module_of)
        new.update(enumerate(outs))
    for key, old in pairs:
        old.replace_all_uses_with(new[key])
    gone = {old for _, old in pairs} | set(mt.nodes)
    for m in sorted(gone, key=order.__getitem__, reverse=True):  # readers first
        if not m.users:
            graph.erase_node(m)
    return True


__all__ = ["ActivationMatch", "CUBIC", "SQRT_2_OVER_PI", "find_activations", "fuse_activations", "match_aten_gelu",
           "match_at", "match_gelu_backward", "match_swiglu", "match_tanh_gelu", "rewrite"]
