"""RMSNorm written out in ATen ops (Hugging Face's LlamaRMSNorm, nn.RMSNorm / F.rms_norm on CPU),
forward and backward, found in a joint graph and replaced by fxspeed::rms_norm_fwd / _bwd.

fuse_kernels calls `fuse_rms_norms` (`match_at` + `rewrite` per rsqrt). The forms are exactly the ones AOT export
records for `w * (x * rsqrt(mean(x^2, -1, keepdim) + eps))` (torch 2.13, fp32 capture; the
casts of HF's `to(float32)` / `to(input_dtype)` are no-ops there and insert_casts keeps the
norm in fp32, so bf16 programs show the same region with casts only around it):

    before (forward)                          before (backward; gh = grad of x * r)
      p = pow(x, 2)                             gh = mul(dy, w)                 (weight; else gh = dy)
      m = mean.dim(p, [-1], True)               wg = mul(dy, h)                 (weight gradient)
      a = add(m, eps)                           sm = sum.dim_IntList(wg, [0..nd-2], True)
      r = rsqrt(a)                              gw = view(sm, [N])
      h = mul(x, r)                             t1 = mul(gh, r)                 (dx, first term)
      y = mul(w, h)          (weight)           q = mul(gh, x); s = sum.dim_IntList(q, [-1], True)
                                                v = mul(mul.Scalar(s, -0.5), pow(r, 3))
                                                d = div.Scalar(expand(v, x.shape), N)
                                                t2 = mul(d, mul.Scalar(pow(x, 1.0), 2.0))  (dx, 2nd term)
                                                z = add(A, t2)   (autograd accumulating x's gradient)

    after
      f = fxspeed.rms_norm_fwd(x, [N], w, eps); y' = f[0]; r' = f[1]
      b = fxspeed.rms_norm_bwd(dy, x, [N], r', w); dx = b[0]; gw' = b[1]
      t1 -> dx, z -> A (dx already holds t2), gw -> gw'; p, m, a, r, h, y, wg, ... are erased

so backward reads x and rstd instead of x, rstd, h (and pow(x, 2) is never kept). Muls are
matched in either operand order (IEEE multiplication commutes exactly); anything else — another
reduction dim, another exponent, eps after the rsqrt, an intermediate read by a node outside the
pattern, a region not in fp32, mixed dtypes — leaves the norm untouched.

Why the rewrite is exact (structural proof, no numeric check at compile time): with
xhat = x r, t1 + t2 = gh r + (-1/2 s r^3 / N) 2 x = r (gh - xhat sum(gh xhat) / N), which is
rms_norm_bwd's input gradient for wdy = gh, i.e. for (dy, w) when gh = dy w, or (gh, no weight);
gw = sum over the leading dims of dy xhat, its weight gradient. These are identities of the
matched nodes' values whatever dy is, so the match needs no knowledge of which node is "the
gradient of y"; and replacing t1 by the sum and dropping t2 from its add leaves the sum autograd
accumulates for x unchanged (up to rounding order). When the weight cannot be folded (gh is not
exactly mul(dy, w) read only by the pattern, or the weight gradient has another form), the
norm is still matched without a weight: h = x r' is the fused output, and `y = mul(w, h)`,
the weight gradient and gh stay as they were (correct; only the saving of h is lost).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.fx as fx

from fxspeed.compiler.rewrite import call

from .pattern_match import (inherit_meta, is_call, is_like, is_number, mul_operand,
                            rewrite_each, same_meta, tensor_value, users_of)

aten = torch.ops.aten
# Every captured region is fp32 (capture is fp32; insert_casts keeps norms fp32). A region computed
# in bf16/fp16 (a low-precision model whose norm does not upcast) was never seen: the fused
# kernels would compute it in fp32, which is a different result, so it is left alone.
_FLOATS = (torch.float32,)


@dataclass
class RMSNormBackward:
    """The backward region of one matched norm."""

    grad: fx.Node  # what rms_norm_bwd reads as grad_out: dy (weight folded) or gh
    term1: fx.Node  # mul(gh, r): replaced by the fused input gradient
    term2_add: fx.Node  # add(A, t2): replaced by A
    term2: fx.Node
    weight_grad: Optional[fx.Node]  # view(sum(mul(dy, h))): replaced by the fused weight gradient
    nodes: list[fx.Node] = field(default_factory=list)  # every node of the region, erased when dead
    first: Optional[fx.Node] = None  # earliest node reading grad (the fused backward goes before it)


@dataclass
class RMSNormMatch:
    """One written-out RMSNorm: x normalized over its last dim (N elements), eps, weight."""

    x: fx.Node
    n: int
    eps: float
    weight: Optional[fx.Node]  # folded into the fused ops (y = mul(w, h)), or None
    out: fx.Node  # y (weight) or h: replaced by the fused output
    rsqrt: fx.Node
    forward: list[fx.Node]  # p, m, a, r, h(, y)
    backward: Optional[RMSNormBackward]


# --- small structural predicates ----------------------------------------------------------------

def _last_dim(dims: Any, ndim: int) -> bool:
    return isinstance(dims, (list, tuple)) and list(dims) in ([-1], [ndim - 1])


# --- forward ------------------------------------------------------------------------------------

def _match_forward(r: fx.Node) -> Optional[tuple[fx.Node, int, float, fx.Node, list[fx.Node]]]:
    """(x, N, eps, h, [p, m, a, r, h]) when r = rsqrt(mean(pow(x, 2), [-1], True) + eps)."""
    if not is_call(r, aten.rsqrt.default, 1):
        return None
    a = r.args[0]
    if not (is_call(a, aten.add.Tensor, 2) or is_call(a, aten.add.Scalar, 2)):
        return None
    m, eps = a.args
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps >= 0:
        return None
    if not is_call(m, aten.mean.dim, 3) or m.args[2] is not True:
        return None
    p = m.args[0]
    if not is_call(p, aten.pow.Tensor_Scalar, 2) or not is_number(p.args[1], 2):
        return None
    x = p.args[0]
    xv = tensor_value(x)
    if xv is None or xv.dtype not in _FLOATS or xv.dim() < 2 or xv.shape[-1] < 1 or not _last_dim(m.args[1], xv.dim()):
        return None
    shape, stat = tuple(xv.shape), (*xv.shape[:-1], 1)
    if not (is_like(p, shape, xv.dtype) and is_like(m, stat, xv.dtype) and is_like(a, stat, xv.dtype)
            and is_like(r, stat, xv.dtype)):
        return None
    if users_of(p) != {m} or users_of(m) != {a} or users_of(a) != {r}:
        return None
    hs = [u for u in r.users if mul_operand(u, r) is x]
    if len(hs) != 1 or not is_like(hs[0], shape, xv.dtype):
        return None
    h = hs[0]
    return x, int(xv.shape[-1]), float(eps), h, [p, m, a, r, h]


# --- backward -----------------------------------------------------------------------------------

def _match_dx(x: fx.Node, r: fx.Node, h: fx.Node, n: int) -> Optional[tuple[fx.Node, fx.Node, fx.Node, fx.Node,
                                                                              fx.Node, list[fx.Node]]]:
    """The input-gradient region reading r: (gh, term1, term2, add of term2, q, its nodes); None
    when r has readers besides h that are not exactly this region."""
    xv = tensor_value(x)
    shape, dt = tuple(xv.shape), xv.dtype
    rest = users_of(r) - {h}
    if len(rest) != 2:
        return None
    c = next((u for u in rest if is_call(u, aten.pow.Tensor_Scalar, 2) and u.args[0] is r and is_number(u.args[1], 3)), None)
    t1 = next((u for u in rest if u is not c), None)
    if c is None or t1 is None:
        return None
    gh = mul_operand(t1, r)
    if gh is None or gh is x or not is_like(gh, shape, dt) or not is_like(t1, shape, dt):
        return None
    # t1 becomes the whole input gradient (t1 + t2): sound only where t1 is one term of x's
    # gradient sum, read once, as autograd's accumulation reads it
    if len(t1.users) != 1:
        return None
    if len(c.users) != 1:
        return None
    v = next(iter(c.users))
    k = mul_operand(v, c)
    if not (is_call(k, aten.mul.Scalar, 2) and is_number(k.args[1], -0.5) and users_of(k) == {v}):
        return None
    s = k.args[0]
    if not (is_call(s, aten.sum.dim_IntList, 3) and _last_dim(s.args[1], len(shape)) and s.args[2] is True
            and users_of(s) == {k}):
        return None
    q = s.args[0]
    if mul_operand(q, gh) is not x or users_of(q) != {s}:
        return None
    if len(v.users) != 1:
        return None
    e = next(iter(v.users))
    if not (is_call(e, aten.expand.default, 2) and e.args[0] is v and list(e.args[1]) == list(shape)
            and len(e.users) == 1):
        return None
    d = next(iter(e.users))
    if not (is_call(d, aten.div.Scalar, 2) and d.args[0] is e and is_number(d.args[1], n) and len(d.users) == 1):
        return None
    t2 = next(iter(d.users))
    t = mul_operand(t2, d)
    if not (is_call(t, aten.mul.Scalar, 2) and is_number(t.args[1], 2.0) and users_of(t) == {t2}):
        return None
    pw = t.args[0]
    if not (is_call(pw, aten.pow.Tensor_Scalar, 2) and pw.args[0] is x and is_number(pw.args[1], 1.0)
            and users_of(pw) == {t}):
        return None
    region = [q, s, k, c, v, e, d, pw, t, t2, t1]
    if not all(tensor_value(z) is not None and tensor_value(z).dtype == dt for z in region):
        return None
    if len(t2.users) != 1:
        return None
    z = next(iter(t2.users))
    if not is_call(z, aten.add.Tensor, 2) or not is_like(z, shape, dt):
        return None
    other = z.args[0] if z.args[1] is t2 else z.args[1] if z.args[0] is t2 else None
    if other is t2 or not is_like(other, shape, dt):
        return None
    return gh, t1, t2, z, q, region


def _match_weight_grad(dy: fx.Node, h: fx.Node, n: int, ndim: int) -> Optional[list[fx.Node]]:
    """[wg, sm, gw] for gw = view(sum.dim_IntList(mul(dy, h), leading dims, True), [N])."""
    wgs = [u for u in h.users if mul_operand(u, h) is dy]
    if len(wgs) != 1:
        return None
    wg = wgs[0]
    if len(wg.users) != 1:
        return None
    sm = next(iter(wg.users))
    if not (is_call(sm, aten.sum.dim_IntList, 3) and sm.args[0] is wg and list(sm.args[1]) == list(range(ndim - 1))
            and sm.args[2] is True and len(sm.users) == 1):
        return None
    gw = next(iter(sm.users))
    if not (is_call(gw, aten.view.default, 2) and gw.args[0] is sm and list(gw.args[1]) == [n]):
        return None
    return [wg, sm, gw]


# --- the whole norm -----------------------------------------------------------------------------

def _weight_of(h: fx.Node, n: int, dt: torch.dtype) -> Optional[tuple[fx.Node, fx.Node]]:
    """(y, w) when y = mul(w, h) with a [N] weight is h's one reader besides a weight-gradient mul."""
    ys = [(u, w) for u in h.users if (w := mul_operand(u, h)) is not None and is_like(w, (n,), dt)]
    return ys[0] if len(ys) == 1 else None


def match_at(r: fx.Node) -> Optional[RMSNormMatch]:
    """The written-out RMSNorm whose rsqrt is r, weight folded where its form allows, or None."""
    fwd = _match_forward(r)
    if fwd is None:
        return None
    x, n, eps, h, forward = fwd
    xv = tensor_value(x)
    shape, dt = tuple(xv.shape), xv.dtype
    has_backward = users_of(r) != {h}
    dx = _match_dx(x, r, h, n) if has_backward else None
    if has_backward and dx is None:
        return None  # r is read by something else: leave the norm as it is
    yw = _weight_of(h, n, dt)
    if yw is not None:
        y, w = yw
        weighted = _weighted(x, r, h, y, w, n, eps, dt, shape, forward, dx)
        if weighted is not None:
            return weighted
    # No weight (or one that cannot be folded): h is the norm's output and gh its gradient.
    back = None
    if dx is not None:
        gh, t1, t2, z, q, region = dx
        back = RMSNormBackward(grad=gh, term1=t1, term2_add=z, term2=t2, weight_grad=None, nodes=region + [z],
                               first=_earliest([t1, q]))
    return RMSNormMatch(x=x, n=n, eps=eps, weight=None, out=h, rsqrt=r, forward=forward, backward=back)


def _weighted(x: fx.Node, r: fx.Node, h: fx.Node, y: fx.Node, w: fx.Node, n: int, eps: float, dt: torch.dtype,
              shape: tuple, forward: list[fx.Node], dx: Optional[tuple]) -> Optional[RMSNormMatch]:
    if not is_like(y, shape, dt) or w is x:
        return None
    others = users_of(h) - {y}
    if dx is None:  # forward only (inference, the first forward of a recomputed region)
        if others:
            return None
        return RMSNormMatch(x=x, n=n, eps=eps, weight=w, out=y, rsqrt=r, forward=forward + [y], backward=None)
    gh, t1, t2, z, q, region = dx
    dy = mul_operand(gh, w)
    if dy is None or not is_like(dy, shape, dt) or users_of(gh) != {t1, q}:
        return None
    wgrad = _match_weight_grad(dy, h, n, len(shape)) if others else []
    if wgrad is None or (wgrad and others != {wgrad[0]}):
        return None
    back = RMSNormBackward(grad=dy, term1=t1, term2_add=z, term2=t2, weight_grad=wgrad[-1] if wgrad else None,
                           nodes=[gh, *wgrad, *region, z], first=_earliest([gh, t1, q, *wgrad[:1]]))
    return RMSNormMatch(x=x, n=n, eps=eps, weight=w, out=y, rsqrt=r, forward=forward + [y], backward=back)


def _earliest(nodes: list[fx.Node]) -> fx.Node:
    g = nodes[0].graph
    wanted = set(nodes)
    return next(m for m in g.nodes if m in wanted)


def find_rms_norms(graph: fx.Graph) -> list[RMSNormMatch]:
    """Every written-out RMSNorm of `graph` (one per rsqrt that anchors the exact pattern), as the
    graph is now: `fuse_rms_norms` matches each again just before rewriting it, because one
    rewrite can change another's region (two norms of one x share the add of their gradients)."""
    return [mt for r in graph.nodes if r.op == "call_function" and r.target is aten.rsqrt.default
            if (mt := match_at(r)) is not None]


def fuse_rms_norms(graph: fx.Graph, module_of: dict[str, str]) -> int:
    """Rewrite every written-out RMSNorm of `graph`; the number rewritten."""
    return rewrite_each(graph, aten.rsqrt.default, match_at, rewrite, module_of)


# --- the rewrite --------------------------------------------------------------------------------

def rewrite(graph: fx.Graph, mt: RMSNormMatch, module_of: dict[str, str]) -> bool:
    """Replace one matched norm by the fused ops (the docstring's before/after). Returns False,
    leaving the graph as it was, when the fused ops' shapes/dtypes differ from the matched nodes'
    or the backward region does not come after the forward."""
    order = {m: i for i, m in enumerate(graph.nodes)}
    bk = mt.backward
    if bk is not None and not order[bk.first] > order[mt.out]:
        return False
    made: list[fx.Node] = []
    with graph.inserting_before(mt.out):
        f = call(graph, torch.ops.fxspeed.rms_norm_fwd.default, (mt.x, [mt.n], mt.weight, mt.eps))
        out = call(graph, operator.getitem, (f, 0))
        rstd = call(graph, operator.getitem, (f, 1))
    made += [f, out, rstd]
    ok = same_meta(out, mt.out) and same_meta(rstd, mt.rsqrt)
    if ok and bk is not None:
        with graph.inserting_before(bk.first):
            b = call(graph, torch.ops.fxspeed.rms_norm_bwd.default, (bk.grad, mt.x, [mt.n], rstd, mt.weight))
            dx = call(graph, operator.getitem, (b, 0))
            dw = call(graph, operator.getitem, (b, 1)) if bk.weight_grad is not None else None
        made += [b, dx, *([dw] if dw is not None else [])]
        ok = same_meta(dx, bk.term1) and (dw is None or same_meta(dw, bk.weight_grad))
    if not ok:
        for m in reversed(made):
            graph.erase_node(m)
        return False
    for new, old in ((f, mt.out), (out, mt.out), (rstd, mt.rsqrt)):
        inherit_meta(new, old, module_of)
    mt.out.replace_all_uses_with(out)
    if bk is not None:
        for new, old in ((b, bk.term1), (dx, bk.term1), *(((dw, bk.weight_grad),) if dw is not None else ())):
            inherit_meta(new, old, module_of)
        bk.term1.replace_all_uses_with(dx)
        z = bk.term2_add
        kept = z.args[0] if z.args[1] is bk.term2 else z.args[1]  # read after t1 -> dx: may be dx itself
        z.replace_all_uses_with(kept)
        if dw is not None:
            bk.weight_grad.replace_all_uses_with(dw)
    region = mt.forward + (bk.nodes if bk is not None else [])
    for m in sorted(set(region), key=order.__getitem__, reverse=True):  # readers first
        if not m.users:
            graph.erase_node(m)
    if not rstd.users:  # a norm without backward (inference, a checkpointed layer's first forward)
        graph.erase_node(rstd)
    return True


__all__ = ["RMSNormBackward", "RMSNormMatch", "find_rms_norms", "fuse_rms_norms", "match_at", "rewrite"]
