"""Tensor-parallel placements: which value of the joint graph each tp rank holds, chosen by cost.

Every tensor of the annotated joint ATen graph gets a placement over the T tensor-parallel
ranks:

    R          replicated: every rank holds the whole tensor
    S(d, b)    sharded on dim d: the dim is read as b equal blocks and each block is split into T
               contiguous pieces, rank t holding piece t of every block (b > 1 is how a fused QKV
               projection [D, 3D] is split so that q, k and v each come out sharded by heads)
    S(d, b, r) sharded over groups (rep=r > 1): each block split into T/r pieces, piece g held by
               the r consecutive ranks g*r .. g*r+r-1 (rank t holds piece t // r). Grouped-query
               attention with fewer key/value heads than ranks: the k/v weights are S(0, rep=T/kv),
               one key/value head per group of ranks, repeated for the query heads of each rank
    P          partial sum: every rank holds a full-shape tensor, the value is their sum
    PS(d, b, r) partial sums within groups: laid out as S(d, b, r), and the value of piece g is the
               sum over the r ranks of group g (the gradient of a k/v head from each rank's query
               heads); made for free from S(d, b) by zero-padding each rank's piece into its
               group's, turned into P for free by zero-padding, and into R/S by one all-reduce of
               the padded value (passes/parallel/shard_tensors.py)

Propagation is per op, from the placements of its inputs (`_strategies`): each op offers the
placements it can run on (a matmul column-parallel, row-parallel into P, attention by heads,
pointwise ops on any matching shard, views mapping a shard through the reshape, ...) plus the
always-correct fallback "every input replicated". The cheapest strategy is taken, counting
per rank compute (the roofline time of the node / T when it runs on shards), the collectives
its inputs need (P -> R all-reduce, S -> R all-gather; R -> S is a local slice and free) and,
for a P result, the all-reduce it will need. An op without a rule only ever runs replicated,
so a missing rule costs speed, never correctness.

The choice that is searched is the placement of every trainable parameter of two or more dims
(the parameters a layout is about); the rest follows by propagation, and a 1-D parameter
(bias, norm weight) whose readers all want the same shard takes it. The search (`solve`):

    1. seed: propagate with every parameter "free" (replicated, but readers may slice it), and
       give each parameter the shard its readers chose; or every parameter whole, if cheaper;
    2. local search: try every other placement of each parameter (one move applies to the same
       parameter of every repeated block: blocks are solved once; the weights multiplying the
       same activation, q/k/v or gate/up, also move together, since attention pays off only with
       all three split), keep a move that lowers the total cost, until none does. A parameter
       left replicated whose readers slice it takes that slice when that is cheaper.

The search is a heuristic, not an exact solver (autoparallel solves an ILP): it can miss a
layout that needs several unrelated parameters to move at once.

Total cost = sum of per-rank node times + collective times (bytes / link bandwidth + latency)
+ the optimizer step over this rank's parameter bytes (the memory term, in seconds). The
Megatron layout (attention column- then row-parallel by heads, the MLP column- then
row-parallel) is what this search finds on transformer blocks once compute outweighs
collective latency; nothing here knows module names beyond telling repeated blocks apart.

The result is written as `node.meta["fxspeed_tp"]` (a `NodePlacement` per node) and
`gm.meta["fxspeed_tp_params"]` (parameter name -> Placement); `passes/parallel/shard_tensors.py`
applies it. `make_placement_analysis` wraps it as the pass-manager analysis "tp_placements",
handed to the compiler the way `analyze` is, so the compiler never imports the planner.
"""

from __future__ import annotations

import math
import operator
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

from fxspeed.compiler.rewrite import VIEW_LIKE, gather_root, view_path
from fxspeed.devices import DeviceSpec
from fxspeed.errors import ConfigError, warn_user
from fxspeed.ir.attention import MASKS, PER_HEAD, SDPA_BACKWARD, SDPA_FORWARD, sdpa_arg, sdpa_input_names
from fxspeed.ir import META_KEY
from fxspeed.ir.program import draws_random

aten = torch.ops.aten
TP_KEY = "fxspeed_tp"
PARAMS_KEY = "fxspeed_tp_params"


@dataclass(frozen=True)
class Placement:
    kind: str  # "R" | "S" | "P" | "PS"
    dim: int = 0
    blocks: int = 1
    rep: int = 1  # S/PS: each piece held by `rep` consecutive ranks (T / rep pieces per block)

    def __str__(self) -> str:
        if self.kind in ("S", "PS"):
            extra = (f",blocks={self.blocks}" if self.blocks > 1 else "") + (f",rep={self.rep}" if self.rep > 1 else "")
            return f"{self.kind}({self.dim}{extra})"
        return self.kind

    def pieces(self, T: int) -> int:
        """How many distinct pieces each block of the sharded dim is cut into over T ranks."""
        return T // self.rep

    def at(self, dim: int, blocks: int | None = None) -> "Placement":
        """The same kind of shard (and replication) on another dim."""
        return Placement(self.kind, dim, self.blocks if blocks is None else blocks, self.rep)


R = Placement("R")
P = Placement("P")


def S(dim: int, blocks: int = 1, rep: int = 1) -> Placement:
    return Placement("S", dim, blocks, rep)


def PS(dim: int, blocks: int = 1, rep: int = 1) -> Placement:
    return Placement("PS", dim, blocks, rep)


_SHARDS = ("S", "PS")


# A parameter kept whole and never sliced by its readers (a search option: e.g. an LM head
# whose vocabulary-sharded logits would need gathering). Placed R in the graph.
WHOLE = Placement("R", -1)


@dataclass
class NodePlacement:
    """What one node runs on: `out` (a tuple for multi-output ops) and `want`, the placement
    each tensor input must have (in fx.node.map_arg order over args then kwargs);
    `reduce_before_bias`: addmm whose matmul part is a partial sum (row-parallel with a bias):
    the rewrite all-reduces the product and then adds the bias once."""

    out: Any
    want: list[Placement]
    reduce_before_bias: bool = False
    sharded: bool = False  # runs on 1/T of the work
    rewrite: str = ""  # VOCAB: the op is rewritten to run on this rank's rows of the vocabulary


@dataclass
class Strategy:
    want: list[Placement]
    out: Any
    div: bool = False
    reduce_before_bias: bool = False
    rewrite: str = ""
    inner: tuple[int, ...] = ()  # bytes of the all-reduces the rewrite itself makes


# Vocabulary-parallel rules (Megatron's VocabParallelEmbedding and parallel cross-entropy), here
# as placements the search may choose, never as a layout chosen by name. With the vocabulary
# dim sharded, S(0) of an embedding table / S(1) of the logits:
#   embedding(W S(0), ids R)            -> P: each rank looks up the ids in its rows, zeros elsewhere
#   embedding_dense_backward(g R, ids R) -> S(0): each rank accumulates its rows only
#   _log_softmax(x S(-1), -1)           -> S(-1): all-reduce max and sum of exp per row
#   nll_loss_forward(lp S(1), target R) -> (P, R): each rank picks the targets in its rows
#   nll_loss_backward, _log_softmax_backward_data: the same, the latter all-reduces a row sum
# passes/parallel/shard_tensors.py applies them (its `_vocab_*` rewrites).
VOCAB = "vocab"

# --- shapes and dims ----------------------------------------------------------------------------

# Matmuls whose output is split into k equal parts downstream (a fused QKV projection): a
# weight sliced for them is sliced in k blocks. Set by solve.
_PREFER: dict[fx.Node, int] = {}
# Matmuls whose output is repeated for grouped-query attention with kv < T key/value heads (the
# k and v projections): a weight sliced for them is sliced over groups of T / kv ranks, so each
# rank holds its query heads' key/value head. Set by solve.
_PREFER_REP: dict[fx.Node, int] = {}
# embedding_dense_backward nodes whose gradient goes to a table placed S(0) in the assignment
# being propagated: only they run vocabulary-parallel (elsewhere their sharded output would be
# gathered again). Set by propagate.
_VOCAB_BACKWARD: set[fx.Node] = set()
_SHAPES: dict[fx.Node, Any] = {}  # memo for one solve (cleared by solve): shapes are read many times
_ARGS: dict[fx.Node, list[fx.Node]] = {}  # memo for one solve: each node's tensor inputs (propagate)
# Memo for one solve (None outside it): a node's cheapest strategy, keyed by what the choice reads
# that changes between the search's trial layouts: its inputs' placements, which inputs are
# derived from parameters alone, and whether it runs vocabulary-parallel. The search propagates
# the whole graph once per trial (T5 at TP=2: 73 times over ~1100 nodes) while a trial moves
# one block's weights, so most nodes see the inputs they saw before.
_CHOICES: dict[tuple, Strategy] | None = None


def _shape(n: Any) -> tuple[int, ...] | None:
    got = _SHAPES.get(n, _SHAPES)
    if got is not _SHAPES:
        return got
    v = n.meta.get("val") if isinstance(n, fx.Node) else None
    got = tuple(int(s) for s in v.shape) if isinstance(v, torch.Tensor) else None
    _SHAPES[n] = got
    return got


def _valid(p: Placement, shape: tuple[int, ...] | None, T: int) -> bool:
    if p.kind not in _SHARDS:
        return True
    return shape is not None and 0 <= p.dim < len(shape) and T % p.rep == 0 and \
        shape[p.dim] % (p.blocks * p.pieces(T)) == 0


def _finer(src: Placement, dst: Placement) -> bool:
    """dst is a local slice of what src holds: the same dim and blocks, each of src's pieces cut
    into src.rep / dst.rep (a group's key/value heads -> this rank's query heads' ones)."""
    return src.kind == dst.kind == "S" and (src.dim, src.blocks) == (dst.dim, dst.blocks) and \
        src.rep % dst.rep == 0 and src.rep > dst.rep


def reshape_placement(src: tuple[int, ...], dst: tuple[int, ...], p: Placement, T: int) -> Placement | None:
    """The placement of `reshape(x, dst)` when x (shape src) is placed `p`, or None when the shard
    does not survive the reshape as a shard of one output dim (e.g. heads not divisible by T)."""
    if p.kind not in _SHARDS:
        return p
    n = p.pieces(T)
    if n == 1 and p.blocks == 1:
        # One piece held by every rank (MQA's key/value head): the whole value, the dim only says
        # which dim is "the heads" one. It goes to the first output dim starting at the same
        # element offset (a size-1 kv dim included: [B, S, hd] -> [B, S, 1, hd] keeps it on kv).
        before = math.prod(src[:p.dim])
        for k in range(len(dst) + 1):
            if k < len(dst) and math.prod(dst[:k]) == before:
                return p.at(k)
    # Group dims into the smallest runs of equal element count on both sides.
    i = j = 0
    while i < len(src):
        i0, j0 = i, j
        a, b = src[i], dst[j] if j < len(dst) else 1
        i += 1
        j += 1
        while a != b:
            if a < b:
                a *= src[i]
                i += 1
            else:
                b *= dst[j]
                j += 1
        while i < len(src) and src[i] == 1 and (j >= len(dst) or dst[j] != 1):
            i += 1
        if i0 <= p.dim < i:
            outer = math.prod(src[i0:p.dim]) * p.blocks
            prefix = 1
            for k in range(j0, j):
                if outer % prefix == 0:
                    blocks = outer // prefix
                    if dst[k] % blocks == 0 and dst[k] > blocks and (dst[k] // blocks) % n == 0:
                        return p.at(k, blocks)
                prefix *= dst[k]
            return None
    return None


# --- op rules -----------------------------------------------------------------------------------

_VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default}
_SAME = {aten.clone.default, aten._to_copy.default, aten.lift_fresh_copy.default, aten.alias.default,
         aten.detach.default}
_POINTWISE = {aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor, aten.gelu.default,
              aten.native_dropout_backward.default,
              aten.gelu_backward.default, aten.silu.default, aten.silu_backward.default, aten.sigmoid.default,
              aten.sigmoid_backward.default, aten.tanh.default, aten.tanh_backward.default, aten.neg.default,
              aten.pow.Tensor_Scalar, aten.rsqrt.default, aten.cos.default, aten.sin.default, aten.mul.Scalar,
              aten.div.Scalar, aten.add.Scalar, aten.sub.Scalar, aten.exp.default, aten.sqrt.default,
              aten.relu.default, aten.threshold_backward.default, aten.where.self, aten.fill.Scalar,
              aten.empty_like.default, aten.zeros_like.default, aten.ones_like.default, aten.masked_fill.Scalar, *_SAME}
# Linear in every tensor argument at once (P in, P out).
_WALK_BACK = {*_VIEWS, aten.clone.default, aten._to_copy.default}
_LINEAR = {aten.add.Tensor, aten.sub.Tensor, aten.neg.default, aten.mul.Scalar, aten.div.Scalar, *_SAME}


# Dropout of a sharded activation: every rank draws the whole mask, as one device would, and
# keeps its own piece (passes/parallel/shard_tensors.py). The masks then equal a one-device
# run's under the same seed, and every rank's generator advances alike, so the random ops after
# it (replicated ones draw whole on every rank) stay equal too. The price is drawing T times the
# bits a rank keeps; Megatron instead seeds each rank apart, which is cheaper and not reproducible.
DRAW_WHOLE = "draw_whole"


def _tensor_args(node: fx.Node) -> list[fx.Node]:
    out: list[fx.Node] = []
    fx.node.map_arg((node.args, node.kwargs), lambda n: out.append(n) or n)
    return out


def _dim(d: int, nd: int) -> int:
    return d % nd if nd else d


def _strategies(node: fx.Node, ins: list[fx.Node], pl: list[Placement], T: int,
                sequence_parallel: bool = False) -> list[Strategy]:
    """Placements `node` can run on given its inputs' placements `pl` (besides all-replicated).
    `sequence_parallel`: partial sums may also be reduce-scattered into a shard of any dim
    (pointwise ops on them, a row-parallel addmm's product before its bias)."""
    t = node.target
    out_shape = _shape(node)
    shapes = [_shape(a) for a in ins]
    sts: list[Strategy] = []
    a = node.args
    if not ins:
        return sts
    px = pl[0]
    if t in _VIEWS or t in (aten.t.default, aten.transpose.int, aten.permute.default, aten.unsqueeze.default,
                            aten.expand.default, aten.slice.Tensor, aten.slice_backward.default, aten.squeeze.dim,
                            aten.squeeze.dims, aten.squeeze.default):
        if len(ins) != 1:
            return sts
        if px.kind == "P":
            return [Strategy([P], P)]
        if px.kind not in _SHARDS:
            return sts
        nd = len(shapes[0])
        q: Placement | None = None
        if t in _VIEWS:
            q = reshape_placement(shapes[0], out_shape, px, T)
        elif t == aten.t.default:
            q = px.at(1 - px.dim) if nd == 2 else px
        elif t == aten.transpose.int:
            d0, d1 = _dim(a[1], nd), _dim(a[2], nd)
            q = px.at({d0: d1, d1: d0}.get(px.dim, px.dim))
        elif t == aten.permute.default:
            q = px.at([_dim(d, nd) for d in a[1]].index(px.dim))
        elif t == aten.unsqueeze.default:
            k = _dim(a[1], nd + 1)
            q = px.at(px.dim + (1 if px.dim >= k else 0))
        elif t in (aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default):
            if t == aten.squeeze.default:
                gone = [i for i, s_ in enumerate(shapes[0]) if s_ == 1]
            else:
                ds = [a[1]] if t == aten.squeeze.dim else list(a[1])
                gone = [_dim(d, nd) for d in ds if shapes[0][_dim(d, nd)] == 1]
            q = px.at(px.dim - sum(1 for d in gone if d < px.dim)) if px.dim not in gone else None
        elif t == aten.expand.default:
            off = len(out_shape) - nd
            q = px.at(px.dim + off) if out_shape[px.dim + off] == shapes[0][px.dim] else None
        elif t == aten.slice.Tensor:
            q = px if _dim(a[1] if len(a) > 1 else 0, nd) != px.dim else None
        elif t == aten.slice_backward.default:
            q = px if _dim(a[2], len(out_shape)) != px.dim else None
        if q is not None and _valid(q, out_shape, T):
            sts.append(Strategy([px], q, div=False))
        elif t in _VIEWS and px.kind == "S" and px.rep == 1 and _summed_after(node):
            # Grouped-query attention backward: the key/value gradient by query heads [B, h, S, hd]
            # (rank t: heads of its own) viewed as [B, kv, h/kv, S, hd] and summed over the
            # repeats. With fewer kv heads than ranks the heads do not map onto a shard of the kv
            # dim; zero-padded into its group's heads (free) each rank holds a partial sum of its
            # group's kv head: PS, reduced only where a whole or exact value is needed.
            for r in range(2, T + 1):
                if T % r == 0 and _valid(PS(px.dim, px.blocks, r), shapes[0], T):
                    q = reshape_placement(shapes[0], out_shape, PS(px.dim, px.blocks, r), T)
                    if q is not None and _valid(q, out_shape, T):
                        sts.append(Strategy([PS(px.dim, px.blocks, r)], q, div=False))
                        break
        return sts
    if t in _POINTWISE:
        if out_shape is None:
            return sts
        nd = len(out_shape)
        if any(p.kind == "PS" for p in pl):
            return _group_partial_pointwise(node, pl, shapes, out_shape, T)
        cands = _ordered({(p.dim + nd - len(s), p.blocks) for p, s in zip(pl, shapes) if p.kind == "S" and s is not None},
                         {(p.dim + nd - len(s), p.blocks, p.rep) for p, s in zip(pl, shapes) if p.kind == "S" and s is not None})
        if sequence_parallel and any(p.kind == "P" for p in pl) and nd >= 2:
            # a partial sum joins the residual stream (embedding + positions, a block's output +
            # the residual): reduce-scattered into a token shard, whatever dim the others are on
            cands = [(d, b, 1) for d, b in {(d, 1) for d in range(nd - 1)}]
        for d, b, r in cands:
            want = []
            for s in shapes:
                k = d - (nd - len(s)) if s is not None else -1
                want.append(S(k, b, r) if s is not None and k >= 0 and s[k] == out_shape[d] else R)
            if _valid(S(d, b, r), out_shape, T) and all(_valid(w, s, T) for w, s in zip(want, shapes)):
                sts.append(Strategy(want, S(d, b, r), div=True))
        if any(p.kind == "P" for p in pl):
            scalar_ok = t not in (aten.add.Scalar, aten.sub.Scalar)
            if t in _LINEAR and scalar_ok and not (t in (aten.add.Tensor, aten.sub.Tensor) and
                                                   any(not isinstance(v, fx.Node) for v in a[:2])):
                sts.append(Strategy([P] * len(ins), P))
            elif t in (aten.mul.Tensor, aten.div.Tensor, aten.native_dropout_backward.default) and len(ins) == 2 \
                    and pl[0].kind == "P" and \
                    isinstance(a[0], fx.Node) and isinstance(a[1], fx.Node):
                sts.append(Strategy([P, R], P))
            elif t == aten.mul.Tensor and len(ins) == 2 and pl[1].kind == "P":
                sts.append(Strategy([R, P], P))
            elif t == aten.masked_fill.Scalar and pl[0].kind == "P" and a[2] == 0:  # zeroing keeps a sum
                sts.append(Strategy([P, R], P))
        return sts
    if t == aten.mm.default or t == aten.bmm.default:
        k = 0 if t == aten.mm.default else 1
        pa, pb = pl
        bas = {(pa.blocks, pa.rep)} if pa.kind == "S" else {(_PREFER.get(node, 1), _PREFER_REP.get(node, 1))}
        bbs = {(pb.blocks, pb.rep)} if pb.kind == "S" else {(_PREFER.get(node, 1), _PREFER_REP.get(node, 1))}
        cands = [Strategy([S(k, ba, r), R], S(k, ba, r), True) for ba, r in bas]
        cands += [Strategy([R, S(k + 1, bb, r)], S(k + 1, bb, r), True) for bb, r in bbs]
        # contracting a shard gives a partial sum only where every rank holds its own piece (rep 1)
        cands += [Strategy([S(k + 1, b), S(k, b)], P, True) for b in {ba for ba, _ in bas} | {bb for bb, _ in bbs}]
        # bmm over a batch that merged (batch, heads): a head shard is S(0, blocks=batch)
        cands += [Strategy([S(0, b, r), S(0, b, r)], S(0, b, r), True)
                  for _, b, r in _ordered({(0, 1)} | {(0, p.blocks) for p in pl if p.kind == "S"},
                                          {(0, 1, 1)} | {(0, p.blocks, p.rep) for p in pl if p.kind == "S"})] if k else []
        cands += _group_partial_matmul(pa, pb, k)
        for st in cands:
            if all(_valid(w, s, T) for w, s in zip(st.want, shapes)) and _valid(st.out, out_shape, T):
                sts.append(st)
        return sts
    if t == aten.addmm.default and len(ins) == 3:
        bias_s, pa, pb = shapes[0], pl[1], pl[2]
        bas = {(pa.blocks, pa.rep)} if pa.kind == "S" else {(_PREFER.get(node, 1), _PREFER_REP.get(node, 1))}
        bbs = {(pb.blocks, pb.rep)} if pb.kind == "S" else {(_PREFER.get(node, 1), _PREFER_REP.get(node, 1))}
        cands = []
        for ba, r in bas:
            row_bias = S(0, ba, r) if bias_s is not None and len(bias_s) == 2 and bias_s[0] == out_shape[0] > 1 else R
            cands.append(Strategy([row_bias, S(0, ba, r), R], S(0, ba, r), True))
        for bb, r in bbs:
            col_bias = (S(len(bias_s) - 1, bb, r) if bias_s is not None and bias_s[-1] == out_shape[-1] and
                        bias_s[-1] > 1 else R)
            cands.append(Strategy([col_bias, R, S(1, bb, r)], S(1, bb, r), True))
        # row-parallel: the product reduced, then the bias added once (sequence parallel: the
        # product reduce-scattered by rows, a token shard)
        cands += [Strategy([R, S(1, b), S(0, b)], S(0) if sequence_parallel else R, True, reduce_before_bias=True)
                  for b in {ba for ba, _ in bas} | {bb for bb, _ in bbs}]
        for st in cands:
            if all(_valid(w, s, T) for w, s in zip(st.want, shapes)) and _valid(st.out, out_shape, T):
                sts.append(st)
        return sts
    if t in (aten.sum.dim_IntList, aten.mean.dim, aten.sum.default):
        if px.kind == "P":
            return [Strategy([P], P)]
        if px.kind not in _SHARDS:
            return sts
        nd = len(shapes[0])
        dims = [_dim(d, nd) for d in (a[1] if len(a) > 1 and a[1] is not None else range(nd))]
        keep = bool(a[2]) if len(a) > 2 else bool(node.kwargs.get("keepdim", False))
        if px.dim in dims:
            # the pieces' sums add up to the whole sum, unless ranks share a piece (an exact S
            # with rep > 1 would count it rep times); a group's partial sums add up like P
            if t != aten.mean.dim and (px.kind == "PS" or px.rep == 1):
                sts.append(Strategy([px], P, True))
        else:
            q = px.at(px.dim if keep else px.dim - sum(1 for d in dims if d < px.dim))
            if _valid(q, out_shape, T):
                sts.append(Strategy([px], q, True))
        return sts
    if t in (aten._log_softmax.default, aten._softmax.default, aten._safe_softmax.default,
             aten._log_softmax_backward_data.default, aten._softmax_backward_data.default):
        n_t = len(ins)
        nd = len(shapes[0])
        dim = _dim(a[n_t], nd)
        cands = _ordered({(p.dim, p.blocks) for p in pl if p.kind == "S" and p.dim != dim},
                         {(p.dim, p.blocks, p.rep) for p in pl if p.kind == "S" and p.dim != dim})
        for d, b, r in cands:
            if _valid(S(d, b, r), out_shape, T):
                sts.append(Strategy([S(d, b, r)] * n_t, S(d, b, r), True))
        if S(dim) in pl and t in (aten._log_softmax.default, aten._log_softmax_backward_data.default) and \
                _valid(S(dim), out_shape, T):
            # Sharded along the normalized dim (vocabulary-parallel logits): per-row statistics
            # are all-reduced (max and sum of exp forward, the row sum of the gradient backward).
            row = math.prod(out_shape) // out_shape[dim] * 4
            inner = (row, row) if t == aten._log_softmax.default else (row,)
            sts.append(Strategy([S(dim)] * n_t, S(dim), True, rewrite=VOCAB, inner=inner))
        return sts
    if t in SDPA_FORWARD or t in SDPA_BACKWARD:
        st = _attention_strategy(node, ins, shapes, T)
        return [st] if st is not None else []
    if t in (aten.native_layer_norm.default, aten.native_layer_norm_backward.default) and sequence_parallel:
        return _layer_norm_strategies(node, ins, pl, shapes, out_shape, T)
    if t == aten.embedding.default:
        if pl[0].kind == "S" and pl[0].dim == 1:
            q = pl[0].at(len(out_shape) - 1)
            sts.append(Strategy([pl[0], R], q, True))
        frequency = bool(a[3]) if len(a) > 3 else bool(node.kwargs.get("scale_grad_by_freq", False))
        if pl[0] in (R, S(0)) and len(shapes[0]) == 2 and _valid(S(0), shapes[0], T) and not frequency:
            sts.append(Strategy([S(0), R], P, True, rewrite=VOCAB))
        return sts
    if t == aten.embedding_dense_backward.default:
        if px.kind == "P" and _nbytes(node) <= _nbytes(ins[0]):
            # linear in the gradient: partial rows in, a partial table out, reduced as the gradient
            # (where the table is no larger than the rows: a position table, not a vocabulary)
            sts.append(Strategy([P, R], P))
        if px.kind == "S" and px.dim == len(shapes[0]) - 1:
            sts.append(Strategy([px, R], px.at(1), True))
        if node in _VOCAB_BACKWARD and not a[4] and _valid(S(0), out_shape, T):
            sts.append(Strategy([R, R], S(0), True, rewrite=VOCAB))
        return sts
    if t == aten.nll_loss_forward.default and len(ins) == 2 and len(shapes[0]) == 2 and pl[0] == S(1):
        return [Strategy([S(1), R], (P, R), True, rewrite=VOCAB)]  # class weights (a 3rd input): no rule
    if t == aten.nll_loss_backward.default and len(ins) == 4 and len(shapes[1]) == 2 and pl[1] == S(1):
        return [Strategy([R, S(1), R, R], S(1), True, rewrite=VOCAB)]
    if t in (aten.split.Tensor, aten.split_with_sizes.default):
        nd = len(shapes[0])
        dim = _dim(a[2] if len(a) > 2 else node.kwargs.get("dim", 0), nd)
        outs = node.meta.get("val")
        sizes = [int(v.shape[dim]) for v in outs]
        if px.kind == "S" and px.dim != dim:
            res = tuple(px for _ in outs)
            if all(_valid(px, tuple(v.shape), T) for v in outs):
                sts.append(Strategy([px], res, True))
        elif px.kind == "S" and px.blocks == len(sizes) and len(set(sizes)) == 1:
            sts.append(Strategy([px], tuple(S(dim, 1, px.rep) for _ in outs), True))
        elif px.kind == "P":
            sts.append(Strategy([P], tuple(P for _ in outs)))
        return sts
    if t == aten.cat.default:
        # cat skips 1-D empty tensors (an empty KV cache): they stay replicated and take no part.
        empty = [s == (0,) for s in shapes]
        if any(empty) and not all(empty):
            keep = [i for i, e in enumerate(empty) if not e]
            sub = _strategies_cat(node, [ins[i] for i in keep], [pl[i] for i in keep], [shapes[i] for i in keep],
                                  out_shape, T)
            out = []
            for st in sub:
                want = [R] * len(ins)
                for i, w in zip(keep, st.want):
                    want[i] = w
                out.append(Strategy(want, st.out, st.div))
            return out
        return _strategies_cat(node, ins, pl, shapes, out_shape, T)
    return sts


def _ordered(keys: set[tuple[int, int]], cands: set[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """(dim, blocks, rep) candidates in the order of their (dim, blocks) `keys` as a set (the order
    strategies were always tried in: of equal cost, the first wins), reps ascending."""
    return [(d, b, r) for d, b in keys for r in sorted({r for d2, b2, r in cands if (d2, b2) == (d, b)})]


def _summed_after(node: fx.Node) -> bool:
    """Every reader of `node` sums it over some dims (the backward of an expand: repeat_kv's)."""
    return bool(node.users) and all(u.target == aten.sum.dim_IntList for u in node.users)


def _group_partial_pointwise(node: fx.Node, pl: list[Placement], shapes: list[Any], out_shape: tuple[int, ...],
                             T: int) -> list[Strategy]:
    """Pointwise ops on group partial sums (PS): those linear in them, the other operands exact
    (sliced like the output, or broadcast): sums of PS, scaling, negation, copies, zeroing."""
    t, a, nd = node.target, node.args, len(out_shape)
    got = {Placement("PS", p.dim + nd - len(s), p.blocks, p.rep) for p, s in zip(pl, shapes)
           if p.kind == "PS" and s is not None}
    if len(got) != 1:
        return []
    (q,) = got
    linear_in = []  # input positions the op is linear in (all of them must be partial sums)
    if t in _LINEAR and t not in (aten.add.Scalar, aten.sub.Scalar) and not (
            t in (aten.add.Tensor, aten.sub.Tensor) and any(not isinstance(v, fx.Node) for v in a[:2])):
        linear_in = list(range(len(shapes)))
    elif t in (aten.mul.Tensor, aten.div.Tensor) and len(shapes) == 2 and all(isinstance(v, fx.Node) for v in a[:2]):
        linear_in = [i for i, p in enumerate(pl) if p.kind == "PS"]
        if len(linear_in) != 1 or (t == aten.div.Tensor and linear_in != [0]):
            return []
    elif t == aten.masked_fill.Scalar and pl[0].kind == "PS" and a[2] == 0:
        linear_in = [0]
    else:
        return []
    want = []
    for i, s in enumerate(shapes):
        k = q.dim - (nd - len(s)) if s is not None else -1
        whole = s is not None and k >= 0 and s[k] == out_shape[q.dim]
        if i in linear_in:
            if not whole:
                return []
            want.append(q.at(k))
        else:
            want.append(S(k, q.blocks, q.rep) if whole else R)
    if not _valid(q, out_shape, T) or not all(_valid(w, s, T) for w, s in zip(want, shapes)):
        return []
    return [Strategy(want, q, div=True)]


def _group_partial_matmul(pa: Placement, pb: Placement, k: int) -> list[Strategy]:
    """mm/bmm (contraction over A's dim k+1, B's dim k) with a group partial sum (PS) operand:
    linear in it, so PS on a kept dim stays PS; PS on the contracted dim times the exact pieces
    of the same groups sums to the whole product over all ranks (each group's partial sums add
    up to its piece, and the groups' pieces to the whole contraction): P."""
    out = []
    if pa.kind == "PS":
        if pa.dim == k:
            out.append(Strategy([pa, R], pa, True))
        elif pa.dim == k + 1:
            out.append(Strategy([pa, S(k, pa.blocks, pa.rep)], P, True))
        if k and pa.dim == 0:
            out.append(Strategy([pa, S(0, pa.blocks, pa.rep)], pa, True))
    if pb.kind == "PS":
        if pb.dim == k + 1:
            out.append(Strategy([R, pb], pb, True))
        elif pb.dim == k:
            out.append(Strategy([S(k + 1, pb.blocks, pb.rep), pb], P, True))
        if k and pb.dim == 0:
            out.append(Strategy([S(0, pb.blocks, pb.rep), pb], pb, True))
    return out


def _attention_strategy(node: fx.Node, ins: list[fx.Node], shapes: list[Any], T: int) -> Strategy | None:
    """Attention split by heads, forward or backward, whichever kernel the device chose: the
    per-head tensors (queries, keys, values, output, its gradient, log-sum-exp) and a per-head
    mask on dim 1, a mask broadcast over heads replicated; outputs per head. None where that
    is not exact:
    - dropout inside the kernel: its random stream is indexed by the local head, so a rank's
      heads would draw another head's mask (and backward would rebuild masks forward never drew);
    - an output broadcast over heads ([B, 1, ...]: the gradient of a mask shared by heads, of
      keys shared by every query head): a partial sum per rank, which this rule does not reduce;
    - queries that are not [B, heads, L, E]."""
    dropout = sdpa_arg(node, "dropout_p", 0.0)
    if not isinstance(dropout, (int, float)) or dropout != 0:
        return None
    names = sdpa_input_names(node)
    if len(names) != len(ins) or any(s is None for s in shapes):
        return None
    want: list[Placement] = []
    for name, s in zip(names, shapes):
        if name in PER_HEAD:
            want.append(S(1) if len(s) >= 3 and s[1] > 1 else R)
        elif name in MASKS and len(s) >= 3 and s[-3] > 1:  # a mask per head ([B,] heads, L, S)
            if len(s) != 4:
                return None  # [heads, L, S], broadcast over the batch: no rule
            want.append(S(1))
        else:  # a mask broadcast over heads, seeds, sequence lengths
            want.append(R)
    q = shapes[names.index("query")] if "query" in names else None
    if q is None or len(q) != 4 or not all(_valid(w, s, T) for w, s in zip(want, shapes)):
        return None
    outs = node.meta.get("val")
    many = isinstance(outs, (tuple, list))
    res = []
    for v in (outs if many else [outs]):
        if not isinstance(v, torch.Tensor) or v.dim() < 3:
            res.append(R)  # philox seed and offset, sequence lengths, an unused debug mask
        elif v.shape[1] == 1 or not _valid(S(1), tuple(v.shape), T):
            return None
        else:
            res.append(S(1))
    return Strategy(want, tuple(res) if many else res[0], True)


def _layer_norm_strategies(node: fx.Node, ins: list[fx.Node], pl: list[Placement], shapes: list[Any],
                           out_shape: Any, T: int) -> list[Strategy]:
    """Layer norm on a shard of a dim it does not normalize (a token shard under sequence
    parallelism): each rank normalizes its rows. Forward (x, weight, bias) -> (y, mean, rstd) on
    the shard; backward (dy, x, mean, rstd, weight, bias) -> (dx on the shard, dweight and dbias
    partial sums: each rank's rows' share)."""
    backward = node.target == aten.native_layer_norm_backward.default
    x_shape = shapes[1] if backward else shapes[0]
    normalized = len(node.args[2] if backward else node.args[1])
    lead = {(p.dim, p.blocks) for p, s in zip(pl[:2 if backward else 1], shapes) if p.kind == "S"}
    vals = node.meta.get("val")
    sts = []
    for d, b in lead:
        if x_shape is None or d >= len(x_shape) - normalized:
            continue
        q = S(d, b)
        n_act = 4 if backward else 1  # dy, x, mean, rstd / x
        want = [q if i < n_act else R for i in range(len(ins))]
        if backward:
            out = tuple(q if k == 0 else P for k in range(len(vals)))
        else:
            out = tuple(q for _ in vals)
        if all(_valid(w, sh, T) for w, sh in zip(want, shapes)) and all(
                v is None or o.kind != "S" or _valid(o, tuple(v.shape), T) for o, v in zip(out, vals)):
            sts.append(Strategy(want, out, True))
    return sts


def _strategies_cat(node: fx.Node, ins: list[fx.Node], pl: list[Placement], shapes: list[Any],
                    out_shape: Any, T: int) -> list[Strategy]:
    a = node.args
    sts: list[Strategy] = []
    if True:
        nd = len(shapes[0])
        dim = _dim(a[1] if len(a) > 1 else 0, nd)
        if all(p.kind == "P" for p in pl):
            return [Strategy([P] * len(ins), P)]
        cands = _ordered({(p.dim, p.blocks) for p in pl if p.kind == "S" and p.dim != dim},
                         {(p.dim, p.blocks, p.rep) for p in pl if p.kind == "S" and p.dim != dim})
        for d, b, r in cands:
            sts.append(Strategy([S(d, b, r)] * len(ins), S(d, b, r), True))
        if len({s[dim] for s in shapes}) == 1 and all(_valid(S(dim), s, T) for s in shapes):
            sts.append(Strategy([S(dim)] * len(ins), S(dim, len(ins)), True))
        return [s for s in sts
                if _valid(s.out, out_shape, T) and all(_valid(w, sh, T) for w, sh in zip(s.want, shapes))]
    return sts


# --- costs --------------------------------------------------------------------------------------

@dataclass
class CostModel:
    """Seconds per rank. `forward_only` (a serving program): no optimizer step; the weights a
    rank holds are read once per step instead.
    why: docs/decisions/serving-layout-on-the-decode-bucket.md"""

    device: DeviceSpec
    T: int
    latency: float = 0.0
    forward_only: bool = False
    # Config.sequence_parallel: a partial sum becomes a token shard by a reduce-scatter (half an
    # all-reduce's bytes), and an activation partial sum is never all-reduced whole
    sequence_parallel: bool = False

    def __post_init__(self) -> None:
        self.latency = 3e-5 if self.device.kind == "cpu" else 1e-5
        self.bw = self.device.link_bandwidth or 1e9
        self._memo: dict[tuple[fx.Node, bool], float] = {}

    def node(self, node: fx.Node, div: bool | int, whole_bytes: int = 0) -> float:
        """Roofline seconds of `node`, on 1/T of the work when `div` (1/div when an int: shards
        held by groups of ranks split the work into fewer pieces). `whole_bytes`: bytes of its
        inputs every rank still reads whole (a replicated weight beside a token-split activation);
        counted only for serving programs, where reading weights is most of the time."""
        key = (node, div, whole_bytes)
        got = self._memo.get(key)
        if got is None:
            got = self._memo[key] = self._node(node, div, whole_bytes)
        return got

    def _node(self, node: fx.Node, div: bool, whole_bytes: int) -> float:
        inf = node.meta.get(META_KEY)
        if inf is None or inf.is_view:
            return 0.0
        peak = self.device.peak_flops("fp32" if inf.dtype != "bfloat16" else "bf16")
        bw = self.device.mem_bandwidth
        flops_s = inf.flops / peak if peak else 0.0
        moved = inf.bytes_read + inf.bytes_written
        k = self.T if div is True else int(div)
        if k <= 1:
            return max(flops_s, moved / bw if bw else 0.0)
        whole = min(whole_bytes, moved)
        return max(flops_s / k, ((moved - whole) / k + whole) / bw if bw else 0.0)

    def move(self, src: Placement, dst: Placement, nbytes: int) -> float:
        """Seconds to turn a value of `nbytes` (its whole size) placed `src` into `dst`."""
        if src == dst or src.kind == "R" and dst.kind == "S":
            return 0.0
        if dst.kind == "P":
            return 0.0 if src.kind == "PS" else math.inf  # group partial sums zero-padded
        if dst.kind == "PS":  # each rank's own piece zero-padded into its group's
            return 0.0 if src.kind == "S" and src.rep == 1 and (src.dim, src.blocks) == (dst.dim, dst.blocks) \
                else math.inf
        if _finer(src, dst) or src.kind == "S" and src.rep >= self.T and dst.kind == "R":
            return 0.0  # a local slice of what the rank holds; one group holds the whole value
        f = (self.T - 1) / self.T
        if src.kind == "P" and dst.kind == "S" and dst.rep == 1 and self.sequence_parallel:
            return self.latency + f * nbytes / self.bw  # reduce-scatter
        if src.kind in ("P", "PS"):
            # all-reduce (a group partial sum zero-padded to the whole shape), then a local slice for S
            return self.latency + 2 * f * nbytes / self.bw
        return self.latency + f * nbytes * src.rep / self.bw  # all-gather (then a local slice for S)

    def memory(self, nbytes: float) -> float:
        # Adam reads and writes parameter, gradient and two moments: 8 passes over the bytes. A
        # serving step reads each weight it holds: a whole weight its readers slice is read whole.
        passes = 1 if self.forward_only else 8
        return passes * nbytes / self.device.mem_bandwidth if self.device.mem_bandwidth else 0.0


# Seconds added for an activation all-reduced whole under sequence parallelism (far above any step).
SEQUENCE_PARALLEL_PENALTY = 1e3

_NBYTES: dict[fx.Node, int] = {}


def _nbytes(n: fx.Node) -> int:
    got = _NBYTES.get(n)
    if got is None:
        v = n.meta.get("val")
        got = _NBYTES[n] = int(v.numel()) * v.element_size() if isinstance(v, torch.Tensor) else 0
    return got


# --- propagation --------------------------------------------------------------------------------

@dataclass
class Result:
    cost: float
    nodes: dict[fx.Node, NodePlacement]
    wants: dict[fx.Node, set[Placement]] = field(default_factory=dict)  # what readers of a placeholder wanted
    comm: dict[str, float] = field(default_factory=dict)  # collective bytes by kind (per step, per rank)


def propagate(gm: fx.GraphModule, signature: Any, params: dict[str, Placement], cm: CostModel,
              pinned: dict[fx.Node, Any] | None = None) -> Result:
    """One greedy pass in graph order: each node takes its cheapest strategy given its inputs.
    Parameters are placed as `params` says (absent: replicated). `pinned`: nodes whose output
    placement is decided before (see PlacementAnalysis: a serving program's attention)."""
    T = cm.T
    place: dict[fx.Node, Any] = {}
    nodes: dict[fx.Node, NodePlacement] = {}
    wants: dict[fx.Node, set[Placement]] = {}
    comm = {"all_reduce": 0.0, "all_gather": 0.0}
    total = 0.0
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    param_of = {ph: s.target for ph, s in zip(placeholders, signature.inputs) if s.kind == "param"}
    _VOCAB_BACKWARD.clear()
    _VOCAB_BACKWARD.update(_row_sharded_embedding_gradients(gm, signature, params))

    def of(n: fx.Node) -> Placement:
        return place.get(n, R)

    def charge(src: Placement, dst: Placement, n: fx.Node) -> float:
        c = cm.move(src, dst, _nbytes(n))
        if c and c != math.inf:
            kind = "all_gather" if src.kind not in ("P", "PS") else (
                "reduce_scatter" if src.kind == "P" and dst.kind == "S" and dst.rep == 1 and cm.sequence_parallel
                else "all_reduce")
            comm[kind] = comm.get(kind, 0.0) + _nbytes(n)
        return c

    gathered: set[fx.Node] = set()  # values some reader already gathered whole (shard_tensors reuses it)
    # What each value was already converted into for an earlier reader: shard_tensors converts a
    # value once per placement wanted (its cache) and every later reader reuses it, so only the
    # first reader pays. A partial sum read by several ops (a row-parallel output read by a
    # norm's pow and mul, as Gemma2's post-attention and post-feedforward norms read it) is
    # all-reduced once; charged once per reader, it made Megatron's layout look dearer than
    # keeping the attention and MLP weights whole. A tuple (not a set) per value, so that the
    # choice memo can key on it.
    converted: dict[fx.Node, tuple[Placement, ...]] = {}

    def penalty(p: Placement, w: Placement, i: fx.Node) -> float:
        """Sequence parallelism: an activation partial sum is reduce-scattered into a token shard,
        not all-reduced whole. A penalty rather than impossible: a layout with no other way still
        exists, and the search (which sees the whole step's cost) moves the parameters that led here."""
        if cm.sequence_parallel and p.kind == "P" and w.kind == "R" and i not in derived and len(_shape(i) or ()) >= 2:
            return SEQUENCE_PARALLEL_PENALTY
        return 0.0

    def reads(p: Placement, w: Placement, i: fx.Node) -> float:
        """What it costs a reader to get input `i` (placed p) as w."""
        if p != w and w in converted.get(i, ()):
            return 0.0
        if cm.sequence_parallel:
            extra = penalty(p, w, i)
            if extra:
                return extra + cm.move(p, w, _nbytes(i))
            # a view of a value gathered for another reader (a gradient read by the input-gradient
            # matmul and, transposed, by the weight-gradient one) is the view of that gathered value
            if p.kind == "S" and w == R and view_path(i, gathered) is not None:
                return 0.0
        return cm.move(p, w, _nbytes(i))

    # Values computed from parameters and constants alone: the only ones a reader may slice for
    # free (R -> S). Slicing an activation would shard the batch: data parallelism, not tensor
    # parallelism, and its weight gradients would then need reducing.
    derived: set[fx.Node] = set()
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            p = params.get(param_of.get(n, ""), R) if n in param_of else R
            if n in param_of and p != WHOLE:
                derived.add(n)
            place[n] = R if p == WHOLE else p
            nodes[n] = NodePlacement(place[n], [])
            continue
        if n.op == "get_attr":
            derived.add(n)
            continue
        if n.op == "output":
            outs = list(n.args[0])
            want = []
            for o, spec in zip(outs, signature.outputs):
                if not isinstance(o, fx.Node):
                    continue
                w = params.get(spec.target, R) if spec.kind == "grad" else R
                w = R if w == WHOLE else w
                want.append(w)
                total += charge(of(o), w, o)
            nodes[n] = NodePlacement(None, want)
            continue
        if n.op != "call_function":
            continue
        if n.target is operator.getitem:
            src = place.get(n.args[0], R)
            place[n] = src[n.args[1]] if isinstance(src, tuple) else src
            nodes[n] = NodePlacement(place[n], [src if not isinstance(src, tuple) else R])
            continue
        ins = _ARGS.get(n)
        if ins is None:
            ins = _tensor_args(n)
            if _CHOICES is not None:  # inside a solve, which clears it
                _ARGS[n] = ins
        if all(i in derived for i in ins):
            derived.add(n)
        pl = [of(i) if not isinstance(place.get(i), tuple) else R for i in ins]
        # Under sequence parallelism a read's cost also depends on what was gathered before (not keyed)
        key = None if cm.sequence_parallel or _CHOICES is None else (
            n, tuple(pl), tuple([i in derived for i in ins]), n in _VOCAB_BACKWARD,
            tuple([converted.get(i) for i in ins]))
        best = _CHOICES.get(key) if key is not None else None
        if best is None:
            best = _cheapest(n, ins, pl, derived, T, cm, reads, (pinned or {}).get(n))
            if key is not None:
                _CHOICES[key] = best
        for p, w, i in zip(pl, best.want, ins):
            if p != w and w in converted.get(i, ()):
                continue  # converted once already: shard_tensors reuses it
            if reads(p, w, i) == 0.0 and p != w and w == R:
                continue  # gathered once already: shard_tensors reuses it
            c = charge(p, w, i) + penalty(p, w, i)
            total += c
            if c:
                converted[i] = (*converted.get(i, ()), w)
            if p.kind == "S" and w == R:  # shard_tensors gathers the first sharded value of i's view chain
                i = gather_root(i, lambda v: getattr(of(v), "kind", "R") == "S")
                gathered.add(i)
            if i.op == "placeholder":
                wants.setdefault(i, set()).add(w)
        total += cm.node(n, _div(best, T), _whole_bytes(cm, best, ins))
        if best.reduce_before_bias:
            total += charge(P, best.out, n)
        for b in best.inner:
            total += cm.move(P, R, b)
            comm["all_reduce"] += b
        place[n] = best.out
        nodes[n] = NodePlacement(best.out, list(best.want), best.reduce_before_bias, best.div, best.rewrite)
    for ph, name in param_of.items():
        total += cm.memory(_nbytes(ph) / (of(ph).pieces(T) if of(ph).kind == "S" else 1))
    return Result(total, nodes, wants, comm)


def _random_strategies(n: fx.Node, pl: list[Placement], T: int) -> list[Strategy]:
    """Dropout keeps its input's shard (drawn whole, DRAW_WHOLE); every other random op runs
    replicated, each rank drawing the same numbers from generators the engine keeps equal."""
    if n.target == aten.native_dropout.default and pl and pl[0].kind == "S" and _valid(pl[0], _shape(n.args[0]), T):
        return [Strategy([pl[0]], (pl[0], pl[0]), div=False, rewrite=DRAW_WHOLE)]
    return []


def _cheapest(n: fx.Node, ins: list[fx.Node], pl: list[Placement], derived: set[fx.Node], T: int,
              cm: CostModel, reads: Callable[[Placement, Placement, fx.Node], float],
              pin: Any = None) -> Strategy:
    """The strategy of `n` (all-replicated when nothing else is possible) that costs least given
    its inputs' placements `pl`: their reads, its compute and the reductions it leaves. `pin`:
    the output placement `n` must have (its first strategy that gives it, whatever it costs)."""
    val = n.meta.get("val")
    n_out = len(val) if isinstance(val, (tuple, list)) else 0
    fallback = Strategy([R] * len(ins), tuple(R for _ in range(n_out)) if n_out else R)
    options = _random_strategies(n, pl, T) if draws_random(n) else _strategies(n, ins, pl, T, cm.sequence_parallel)
    if pin is not None:
        # A forward-only program has no gradients to reduce, so slicing a replicated activation
        # (R -> S, a local cut) is exact there, where a training program must not shard its batch.
        return next((st for st in [*options, fallback] if st.out == pin), fallback)
    # A partial sum read by several ops is reduced once, where it is made, rather than
    # carried into each reader (each would need its own all-reduce later).
    options = [st for st in options if all(w.kind != "P" or len(i.users) == 1 for w, i in zip(st.want, ins))]
    best, best_cost = fallback, math.inf
    # A partial sum only ever added to others (the input gradients of q, k and v; of gate and
    # up) is reduced once, after the sum: its reduction is charged there, not here, or each
    # term would look as if it paid a whole all-reduce (at TP=8 with GQA the small k/v terms
    # then gathered their operands instead).
    summed = any(st.out == P for st in options) and _only_summed(n)
    for st in [*options, fallback]:
        # A pointwise op may slice a replicated broadcast (expand of size 1 along the dim) to
        # the shard another input has (label smoothing's gradient added to vocabulary-sharded
        # logits): it holds no per-element data there, so no activation is split anew.
        matched = n.target in _POINTWISE and any(p.kind == "S" and p == w for p, w in zip(pl, st.want))
        # So may attention slice a mask broadcast over the heads: CUDA's memory-efficient kernel
        # gets the padding mask [B, 1, L, S] expanded to [B, H, L, S] (aten's preprocess_mask)
        heads = n.target in SDPA_FORWARD or n.target in SDPA_BACKWARD
        c = sum(reads(p, w, i) if p.kind != "R" or w.kind != "S" or i in derived or
                (matched and (w.rep >= T or _broadcast_along(i, w.dim))) or (heads and _broadcast_along(i, w.dim))
                else math.inf for p, w, i in zip(pl, st.want, ins))
        c += cm.node(n, _div(st, T), _whole_bytes(cm, st, ins)) + sum(cm.move(P, R, b) for b in st.inner)
        if st.reduce_before_bias:
            c += cm.move(P, st.out, _nbytes(n))  # the product is reduced before the bias
        elif st.out == P and not summed:
            c += cm.move(P, R, _nbytes(n))  # a partial sum is reduced somewhere
        if c < best_cost:
            best, best_cost = st, c
    return best


def _div(st: Strategy, T: int) -> int:
    """Into how many pieces a strategy splits its node's work: T, or fewer where its shards are
    held by groups of ranks (rep > 1); 1 when it runs whole."""
    if not st.div:
        return 1
    outs = st.out if isinstance(st.out, tuple) else (st.out,)
    reps = [p.rep for p in (*outs, *st.want) if isinstance(p, Placement) and p.kind in _SHARDS]
    return T // max(reps, default=1)


def _row_sharded_embedding_gradients(gm: fx.GraphModule, signature: Any,
                                     params: dict[str, Placement]) -> set[fx.Node]:
    """The embedding_dense_backward nodes whose result is (part of) the gradient of a table placed
    S(0) in `params`: followed back from the gradient output through sums (a tied embedding and
    head add their gradients), casts and views."""
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    found: set[fx.Node] = set()
    for o, spec in zip(out.args[0], signature.outputs):
        if not isinstance(o, fx.Node) or spec.kind != "grad" or params.get(spec.target) != S(0):
            continue
        stack = [o]
        while stack:
            n = stack.pop()
            if n.target == aten.embedding_dense_backward.default:
                found.add(n)
            elif n.op == "call_function" and n.target in (aten.add.Tensor, *_WALK_BACK):
                stack.extend(a for a in n.args[:2] if isinstance(a, fx.Node))
    return found


def _only_summed(n: fx.Node, depth: int = 0) -> bool:
    """Every reader of `n` (through views) adds it to something."""
    if not n.users or depth > 4:
        return False
    return all(u.target == aten.add.Tensor or u.target in _VIEWS and _only_summed(u, depth + 1) for u in n.users)


def _broadcast_along(n: fx.Node, dim: int) -> bool:
    """`n` is an expand of a tensor of size 1 along `dim`."""
    if n.target != aten.expand.default:
        return False
    src, out = _shape(n.args[0]), _shape(n)
    if src is None or out is None:
        return False
    k = dim - (len(out) - len(src))
    return k < 0 or src[k] == 1


def _whole_bytes(cm: CostModel, st: Strategy, ins: list[fx.Node]) -> int:
    """Serving programs: the bytes of the inputs a sharded strategy still reads whole on every
    rank (see CostModel.node)."""
    if not (cm.forward_only and st.div):
        return 0
    return sum(_nbytes(i) for i, w in zip(ins, st.want) if w.kind == "R")


# --- the search ---------------------------------------------------------------------------------

_BLOCK = re.compile(r"(^|\.)(\d+)\.")


def _block_key(name: str) -> tuple[str, int]:
    m = _BLOCK.search(name)
    if not m:
        return name, -1
    return name[:m.start(2)] + "#" + name[m.end(2):], int(m.group(2))


def collapse_blocks(placements: dict[str, str]) -> dict[str, str]:
    """Placements by name with the repeated-block index read as '#' ("blocks.#.mlp.fc.weight"):
    the solver moves a parameter of every repeated block at once, so one line says it for all. A
    parameter whose blocks are laid out differently keeps its names."""
    by_key: dict[str, set[str]] = {}
    for name, p in placements.items():
        by_key.setdefault(_block_key(name)[0], set()).add(p)
    out: dict[str, str] = {}
    for name, p in placements.items():
        key = _block_key(name)[0]
        out[key if len(by_key[key]) == 1 else name] = p
    return out


def _candidates(shape: tuple[int, ...], T: int, blocks: set[int], whole: bool = False,
                reps: Sequence[int] = ()) -> list[Placement]:
    """A parameter's placements to try: whole, and each dim split in `blocks` blocks, over all T
    ranks or (`reps`) over groups of r ranks."""
    out = [WHOLE if whole else R]
    for d in range(len(shape)):
        for b in sorted(blocks):
            for r in (1, *sorted(reps)):
                if _valid(S(d, b, r), shape, T):
                    out.append(S(d, b, r))
    return out


def _follow_views(ph: fx.Node, res: Result, T: int, lenient: bool = False) -> set[Placement] | None:
    """What the readers of parameter `ph` want of it, seen through the views it is read by
    (`t(W)` read as S(1) means W as S(0)). None when a want cannot be mapped back through a view
    (with `lenient`, that reader is left out)."""
    wanted: set[Placement] = set()
    for u in ph.users:
        np_ = res.nodes.get(u)
        if np_ is None:
            continue
        ins = _tensor_args(u) if u.op != "output" else []
        ws = [w for i, w in zip(ins, np_.want) if i is ph]
        if u.op == "output":
            continue
        if u.target in VIEW_LIKE and \
                all(w == R for w in ws):
            # The view itself ran replicated: what did its readers want of it?
            inner = _follow_views(u, res, T, lenient)
            if inner is None:
                if lenient:
                    continue
                return None
            for q in inner:
                back = _invert(u, ph, q, T)
                if back is None:
                    if lenient:
                        continue
                    return None
                wanted.add(back)
            continue
        wanted.update(ws)
    return wanted


def _invert(view: fx.Node, src: fx.Node, q: Placement, T: int) -> Placement | None:
    if q.kind != "S":
        return q
    shape = _shape(src)
    for c in _candidates(shape, T, {q.blocks, 1}, reps=(q.rep,) if q.rep > 1 else ()):
        if c.kind == "S":
            got = _strategies(view, [src], [c], T)
            if got and got[0].out == q:
                return c
    return None


def solve(gm: fx.GraphModule, signature: Any, device: DeviceSpec, T: int,
          fixed: dict[str, Placement] | None = None,
          sequence_parallel: bool = False, groups: bool = True,
          pinned: dict[fx.Node, Any] | None = None) -> tuple[dict[str, Placement], Result]:
    """The cheapest parameter placements found (see the module docstring) and their propagation.
    `fixed`: placements decided before (another program of the same engine): used as they are.
    `groups`: parameters may be split over groups of ranks (S with 1 < rep < T; see
    `group_sizes`); where the runtime cannot count such slices yet, only rep T (MQA's whole
    key/value weights) is tried. `pinned`: nodes whose output placement is decided before
    (propagate; the search then lays out the weights around them)."""
    global _CHOICES
    _SHAPES.clear()
    _NBYTES.clear()
    _ARGS.clear()
    _PREFER.clear()
    _PREFER_REP.clear()
    _CHOICES = {}
    try:
        return _solve(gm, signature, device, T, fixed, sequence_parallel, groups, pinned)
    finally:
        _CHOICES = None
        _SHAPES.clear()
        _NBYTES.clear()
        _ARGS.clear()
        _PREFER.clear()
        _PREFER_REP.clear()
        _VOCAB_BACKWARD.clear()


def _solve(gm: fx.GraphModule, signature: Any, device: DeviceSpec, T: int,
           fixed: dict[str, Placement] | None, sequence_parallel: bool = False,
           groups: bool = True, pinned: dict[fx.Node, Any] | None = None) -> tuple[dict[str, Placement], Result]:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    grads = {s.target for s in signature.outputs if s.kind == "grad"}
    params = {s.target: ph for ph, s in zip(placeholders, signature.inputs) if s.kind == "param"}
    forward_only = not grads  # a serving program: every weight is laid out, not only trainable ones
    if forward_only:
        grads = set(params)
    cm = CostModel(device, T, forward_only=forward_only, sequence_parallel=sequence_parallel)
    # A tied weight fed under several names (a pipeline's joint graph keeps one input per name, so
    # that stages can hold either) is one Parameter: every name takes its canonical name's placement.
    aliases = {a: c for a, c in signature.tied.items() if a in params and c in params}

    def tie(assign: dict[str, Placement]) -> dict[str, Placement]:
        out = {n: p for n, p in assign.items() if n not in aliases}
        out.update({a: out[c] for a, c in aliases.items() if c in out})
        return out

    if fixed is not None:
        # A tied weight's canonical name is the first one a trace meets, which may differ between
        # programs (T5's train step feeds encoder.embed_tokens.weight, its eval step shared.weight)
        known = dict(fixed)
        for a, c in signature.tied.items():
            if c not in known and a in fixed:
                known[c] = fixed[a]
            if a not in known and c in fixed:
                known[a] = fixed[c]
        use = tie({n: p for n, p in known.items() if n in params})
        return use, propagate(gm, signature, use, cm, pinned)
    blocks = {1}
    for n in gm.graph.nodes:
        if n.target in (aten.split.Tensor, aten.split_with_sizes.default):
            vals = n.meta.get("val")
            if isinstance(vals, (list, tuple)) and len({tuple(v.shape) for v in vals}) == 1:
                blocks.add(len(vals))
    units = [name for name, ph in params.items()
             if name in grads and name not in aliases and len(_shape(ph) or ()) >= 2]
    reps = () if forward_only else tuple(r for r in group_sizes(gm, T) if groups or r == T)
    _PREFER_REP.clear()
    if reps:
        _PREFER_REP.update(_repeated_projections(gm, T, reps))
    _PREFER.clear()
    for n in gm.graph.nodes:
        if n.target in (aten.split.Tensor, aten.split_with_sizes.default):
            vals = n.meta.get("val")
            if not (isinstance(vals, (list, tuple)) and len({tuple(v.shape) for v in vals}) == 1):
                continue
            src = n.args[0]
            while isinstance(src, fx.Node) and src.op == "call_function" and src.target in _WALK_BACK:
                src = src.args[0]
            if isinstance(src, fx.Node) and src.target in (aten.mm.default, aten.addmm.default):
                _PREFER[src] = len(vals)
    def key(assign: dict[str, Placement]) -> frozenset[tuple[str, Placement]]:
        """An assignment as propagate reads it (a name absent and a name placed R are alike)."""
        return frozenset((n, p) for n, p in tie(assign).items() if p != R)

    tried: set[frozenset[tuple[str, Placement]]] = set()  # every assignment evaluate was given

    def evaluate(assign: dict[str, Placement]) -> tuple[dict[str, Placement], Result]:
        """Propagate; a unit left replicated (and not WHOLE) takes the shard its readers all chose."""
        assign = tie(assign)
        tried.add(key(assign))
        res = propagate(gm, signature, assign, cm, pinned)
        up = dict(assign)
        for name in units:
            if assign.get(name, R) == R:
                w = _follow_views(params[name], res, T, lenient=True)
                shards = {q for q in w or () if q.kind == "S" and _valid(q, _shape(params[name]), T)}
                if len(shards) == 1:  # readers that wanted it whole then read a slice, or gather it
                    up[name] = shards.pop()
        up = tie(up)
        if up != assign:
            res_up = propagate(gm, signature, up, cm, pinned)
            if res_up.cost <= res.cost:
                return up, res_up
        return assign, res

    # 1. seed: every parameter free to be sliced by its readers; or every one whole, when that
    # is cheaper (slow links: the seed's slices would cost more than they save).
    assign, best = evaluate({})
    whole = {name: WHOLE for name in units}
    res = propagate(gm, signature, whole, cm, pinned)
    if res.cost < best.cost:
        assign, best = whole, res
    if sequence_parallel:
        # Sequence parallelism changes where activations live, not which weights are sliced: the
        # layout found without it (Megatron's, on transformer blocks) starts the search. From the
        # seeds above the search would have to move q/k/v and the output projection at once.
        start, _ = _solve(gm, signature, device, T, None, False, groups, pinned)
        trial, res = evaluate(start)
        if res.cost < best.cost:
            assign, best = trial, res
    # 2. local search over units, repeated blocks moved together.
    groups: dict[str, list[str]] = {}
    for name in units:
        groups.setdefault(_block_key(name)[0], []).append(name)
    # Sibling moves: the weights that multiply the same activation (q, k and v; gate and up) only
    # pay off together (attention needs all three split by heads), so they also move as one.
    moves = list(groups.values())
    siblings: dict[fx.Node, list[str]] = {}
    for name in units:
        act = _multiplied_activation(params[name])
        if act is not None:
            siblings.setdefault(act, []).append(name)
    seen = set()
    for names in siblings.values():
        if len(names) > 1:
            keys = tuple(sorted({_block_key(n)[0] for n in names}))
            if keys not in seen:
                seen.add(keys)
                moves.append([m for k in keys for m in groups[k]])
    for _ in range(3):
        improved = False
        for members in moves:
            shapes = {_shape(params[m]) for m in members}
            common = [c for c in _candidates(_shape(params[members[0]]), T, blocks, whole=True, reps=reps)
                      if all(_valid(c, sh, T) for sh in shapes)]
            for c in common:
                if all(assign.get(m, R) == c for m in members):
                    continue
                trial = dict(assign)
                for m in members:
                    trial[m] = c
                if key(trial) in tried:
                    # Evaluated before (T5 at TP=2: 20 of 93 propagations): it cost no less than
                    # the best of that time, or became the best, and the best has only fallen
                    # since, so it is no move now. Skipped, not memoized: a Result per
                    # assignment would hold a placement per node for the whole search.
                    continue
                trial, res = evaluate(trial)
                if res.cost < best.cost * (1 - 1e-9):
                    assign, best, improved = trial, res, True
        if not improved:
            break
    # 1-D parameters follow their readers in the final layout.
    final = dict(assign)
    for name, ph in params.items():
        if name in grads and name not in final and name not in aliases and len(_shape(ph) or ()) < 2:
            w = _follow_views(ph, best, T)
            if w is not None and len(w) == 1:
                (q,) = w
                if q.kind == "S" and _valid(q, _shape(ph), T):
                    final[name] = q
    final = tie(final)
    if final != assign:
        best = propagate(gm, signature, final, cm, pinned)
    return {n: p for n, p in final.items() if p.kind == "S" or p == WHOLE}, best


def _multiplied_activation(weight: fx.Node) -> fx.Node | None:
    """The activation a weight is multiplied with (its matmul's other operand, views stripped), or None."""
    frontier = [weight]
    for _ in range(3):
        nxt = []
        for n in frontier:
            for u in n.users:
                if u.target in (aten.mm.default, aten.addmm.default):
                    other = [a for a in u.args[-2:] if isinstance(a, fx.Node) and a is not n]
                    if other:
                        x = other[0]
                        while x.op == "call_function" and x.target in (*_VIEWS, aten.t.default):
                            x = x.args[0]
                        return x
                elif u.target in (aten.t.default, aten.transpose.int, *_VIEWS):
                    nxt.append(u)
        frontier = nxt
    return None


def warn_heads(gm: fx.GraphModule, T: int) -> None:
    """Attention whose heads do not split over T ranks is not refused: the solver never places a
    head-dim shard that does not survive the reshape to heads (`reshape_placement`), so that
    attention runs whole on every tp rank (its weights replicated, or split on their input dim
    where the planner finds that cheaper) while the MLP and the vocabulary are still split.
    Heads split when the query heads divide by T and the key/value heads either divide by T too
    or are fewer than T with T a multiple of them (GQA: each serves T / kv ranks). Say so, and
    which T would split them (DeepSpeed's AutoTP splits such heads unevenly; fxspeed's programs
    are the same shape on every tp rank, so it keeps them whole)."""

    from fxspeed.config import ConfigWarning

    heads: list[tuple[int, int]] = []  # (query heads, key/value heads) of each attention seen
    for n in gm.graph.nodes:
        if n.target in SDPA_FORWARD:  # (SDPA's math form, under attention dropout, has no one op: below)
            q, k = _shape(n.args[0]), _shape(n.args[1])
            if q is not None and k is not None and len(q) == 4:
                heads.append((q[1], _kv_heads(n.args[1], k[1])))
    # attention computed eagerly (no SDPA op: HF's attn_implementation="eager", Gemma2's softcapped
    # logits, SDPA's math form under dropout), seen by its probabilities [B, heads, S, S'] (a softmax over keys) times the values;
    # grouped-query attention by its repeat of the key/value heads too (the same pair, once)
    heads += _eager_attention_heads(gm)
    heads += [(h, kv) for _, kv, h in _eager_repeats(gm)]
    seen: set[tuple[int, int]] = set()
    for h, kv in heads:
        if _heads_split(h, kv, T) or (h, kv) in seen:
            continue
        seen.add((h, kv))
        ok = [str(t) for t in range(2, h + 1) if _heads_split(h, kv, t)]
        works = (", ".join(ok[:-1]) + f" or {ok[-1]}" if len(ok) > 1 else ok[0]) if ok else ""
        warn_user(f"Config.tensor={T}: the model's attention has {h} query heads and {kv} key/value "
                  f"head{'s' if kv != 1 else ''}, "
                  f"which do not split evenly over {T} tensor-parallel ranks, so it is not split by heads: "
                  "every tp rank computes whole what does not divide (those weights replicated, or split "
                  "on their input dim where that is cheaper); the MLPs and the vocabulary can still be split"
                  + (f". tensor={works} would split the heads" if works else ""),
                  ConfigWarning)


def _heads_split(h: int, kv: int, T: int) -> bool:
    return h % T == 0 and (kv % T == 0 or T % kv == 0)


def split_heads(attention: Sequence[fx.Node], T: int) -> dict[fx.Node, Any]:
    """The output placements that split each of these attention calls by heads over T ranks,
    for those whose query and key/value heads split (`_heads_split`) and whose split is exact
    (`_attention_strategy`: no dropout inside the kernel, per-head inputs)."""
    pins: dict[fx.Node, Any] = {}
    for n in attention:
        q, k = _shape(n.args[0]), _shape(n.args[1])
        if q is None or k is None or len(q) != 4 or not _heads_split(q[1], _kv_heads(n.args[1], k[1]), T):
            continue
        ins = _tensor_args(n)
        st = _attention_strategy(n, ins, [_shape(a) for a in ins], T)
        if st is not None:
            pins[n] = st.out
    return pins


# between an eager attention's softmax and its product with the values: casts, dropout, the
# matmul's broadcast to [B, heads, S, S'] and its view as [B * heads, S, S']
_PROBS_PATH = {*_VIEWS, aten._to_copy.default, aten.clone.default, aten.expand.default, aten.native_dropout.default,
               operator.getitem, aten.mul.Tensor, aten.detach.default}


def _eager_attention_heads(gm: fx.GraphModule) -> list[tuple[int, int]]:
    """(query heads, key/value heads) of each attention computed without SDPA: a softmax over the
    last dim of a 4-D [B, heads, S, S'] whose probabilities (through casts, dropout and the
    matmul's expand/view) are the left operand of a bmm, the product with the values. The
    key/value heads are the values' before a repeat (`_kv_heads`; eager MHA repeats nothing:
    as many as the query heads). A softmax over channels (dim 1) or read by no product is not
    attention."""
    out = []
    for n in gm.graph.nodes:
        if n.target not in (aten._softmax.default, aten._safe_softmax.default):  # (SDPA's math form: safe)
            continue
        shape = _shape(n.args[0])
        if shape is None or len(shape) != 4 or n.args[1] not in (-1, 3):
            continue
        product, frontier, seen = None, [n], {n}
        while frontier and product is None:
            x = frontier.pop()
            for u in x.users:
                if u.target == aten.bmm.default and u.args[0] is x:
                    product = u
                    break
                if u.target in _PROBS_PATH and u not in seen:
                    seen.add(u)
                    frontier.append(u)
        if product is None:
            continue
        values = product.args[1]
        while isinstance(values, fx.Node) and values.target in _VIEWS:
            values = values.args[0]
        if isinstance(values, fx.Node) and values.target == aten.expand.default and \
                len(_shape(values.args[0]) or ()) == 4:
            values = values.args[0]  # the matmul's broadcast, not a repeat of the key/value heads
        out.append((shape[1], _kv_heads(values, shape[1])))
    return out


_KV_PATH = {*_VIEWS, aten.clone.default, aten._to_copy.default, aten.unsqueeze.default, aten.expand.default,
            aten.transpose.int, aten.permute.default, aten.t.default, aten.add.Tensor, aten.sub.Tensor,
            aten.mul.Tensor, aten.neg.default, aten.cat.default, aten.slice.Tensor}


def _eager_repeats(gm: fx.GraphModule) -> list[tuple[fx.Node, int, int]]:
    """Grouped-query attention computed without SDPA (eager attention: Gemma2's softcapped logits
    are matmuls and pointwise ops): Llama's repeat_kv, the expand [B, kv, 1, S, hd] ->
    [B, kv, n_rep, S, hd] reshaped to [B, kv * n_rep, S, hd], read by no SDPA. Each: (the
    expand, kv, kv * n_rep)."""
    sdpa_reads = {a for n in gm.graph.nodes if n.target in SDPA_FORWARD for a in _tensor_args(n)}
    out = []
    for n in gm.graph.nodes:
        if n.target != aten.expand.default:
            continue
        src, shape = _shape(n.args[0]), _shape(n)
        if src is None or shape is None or len(src) != 5 or src[2] != 1 or shape[2] <= 1:
            continue
        after = [v for u in n.users for v in ([u] if u.target in _VIEWS else
                                             u.users if u.target == aten.clone.default else [])]
        views = [u for u in after if u.target in _VIEWS]
        if not views or any(_shape(v) is None or len(_shape(v)) != 4 for v in views):
            continue
        if any(v in sdpa_reads or any(u in sdpa_reads for u in v.users) for v in views):
            continue  # SDPA's own rule sees it
        out.append((n, src[1], src[1] * shape[2]))
    return out


def _repeated_projections(gm: fx.GraphModule, T: int, reps: Sequence[int]) -> dict[fx.Node, int]:
    """The matmuls (mm/addmm) producing the key and value of a grouped-query attention with kv < T
    key/value heads, found back from its k/v inputs through views, the repeat and pointwise ops
    (rotary embeddings), not through splits (a fused QKV weight is not split over groups): each
    -> T / kv."""
    out: dict[fx.Node, int] = {}
    starts: list[tuple[int, list[Any]]] = []
    for n in gm.graph.nodes:
        if n.target not in SDPA_FORWARD or len(n.args) < 3:
            continue
        k = _shape(n.args[1])
        if k is None or len(k) != 4:
            continue
        starts.append((_kv_heads(n.args[1], k[1]), list(n.args[1:3])))
    starts += [(kv, [e.args[0]]) for e, kv, _ in _eager_repeats(gm)]
    for kv, where in starts:
        if kv >= T or T % kv or T // kv not in reps:
            continue
        for start in where:
            stack, seen = [start], set()
            while stack:
                x = stack.pop()
                if not isinstance(x, fx.Node) or x in seen or len(seen) > 64:
                    continue
                seen.add(x)
                if x.target in (aten.mm.default, aten.addmm.default):
                    out[x] = T // kv
                elif x.op == "call_function" and x.target in _KV_PATH:
                    fx.node.map_arg((x.args, x.kwargs), lambda a: stack.append(a) or a)
    return out


def group_sizes(gm: fx.GraphModule, T: int) -> list[int]:
    """Group sizes r (ranks sharing a piece) worth trying for parameters: T / kv for every
    grouped-query attention with kv < T key/value heads (each key/value head then serves the
    query heads of r ranks: its k/v weights are split over the kv groups, S(0, rep=r))."""
    out = set()
    for n in gm.graph.nodes:
        if n.target in SDPA_FORWARD:
            q, k = _shape(n.args[0]), _shape(n.args[1])
            if q is None or k is None or len(q) != 4:
                continue
            kv = _kv_heads(n.args[1], k[1])
            if kv < T and T % kv == 0 and q[1] % T == 0:
                out.add(T // kv)
    for _, kv, h in _eager_repeats(gm):
        if kv < T and T % kv == 0 and h % T == 0:
            out.add(T // kv)
    return sorted(out)


class PlacementAnalysis:
    """The pass-manager analysis "tp_placements" for one engine (`.graph_pass`). It solves the first
    training program it sees and keeps that parameter layout (`.params`) for every later program
    (eval, other batch shapes), since the live Parameters then hold those slices."""

    def __init__(self, devices: Sequence[DeviceSpec]):
        from fxspeed.compiler.pass_manager import graph_pass

        self.device = devices[0]
        self.params: dict[str, Placement] | None = None
        self.attention: list[Any] | None = None  # the first serving program's attention outputs, in order
        self.comm: dict[str, float] = {}
        self.graph_pass = graph_pass("tp_placements", requires=("annotate",), produces=("tp_placements",),
                                     is_analysis=True)(self._run)

    def _run(self, gm: fx.GraphModule, ctx: Any) -> Any:
        from fxspeed.compiler.pass_manager import PassResult

        T = ctx.options.tp_size
        if T > 1:
            if self.params is None:
                warn_heads(gm, T)
                warn_vocabulary(gm, ctx.signature, T)
            # Slices shared by groups of ranks (1 < rep < T) only where the engine counts them right:
            # its clip norm under ZeRO-1/2/3 and pipelines counts a slice once per tp rank.
            groups = ctx.options.zero == 0 and ctx.options.pipeline == 1
            # Serving: every program (one per token bucket) writes the same KV cache, so each
            # attention keeps the first program's split of its heads. Left to the cost model, a
            # bucket of more tokens may compute an attention whole on every rank (where gathering
            # small weights is cheaper than gathering activations) and cache all key/value heads.
            serving = any(s.kind == "tokens" for s in ctx.signature.inputs)  # (compile_inference's programs)
            attention = [n for n in gm.graph.nodes if n.target in SDPA_FORWARD] if serving else []
            if self.attention is not None and len(self.attention) == len(attention):
                pinned = dict(zip(attention, self.attention))
            else:
                # The first serving program splits every attention by heads where they divide
                # (Megatron's layout, and each rank caches only its heads): its cost model sees one
                # step, not the cache. Left to it, a model up to about 2048 wide on an H100 preset
                # ran attention whole on every rank (a step saves an all-reduce's latency), which
                # holds all key/value heads in every rank's cache: half the requests fit.
                pinned = split_heads(attention, T) or None
            params, res = solve(gm, ctx.signature, self.device, T, fixed=self.params,
                                sequence_parallel=ctx.options.sequence_parallel, groups=groups, pinned=pinned)
            if self.params is None:
                self.params, self.comm = params, dict(res.comm)
            if serving and self.attention is None:
                self.attention = [res.nodes[n].out for n in attention]
            for n, npl in res.nodes.items():
                n.meta[TP_KEY] = npl
            gm.meta[PARAMS_KEY] = dict(params)
        return PassResult(gm, modified=False)


def warn_vocabulary(gm: fx.GraphModule, signature: Any, T: int) -> None:
    """An embedding table whose rows (the vocabulary) do not split over T ranks cannot be placed
    by rows (vocabulary-parallel embedding, head and cross-entropy): it stays whole or is split on
    its hidden dim, which all-gathers it for the head. Say so, and the padded size that would work."""

    from fxspeed.config import ConfigWarning

    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    names = {ph: s.target for ph, s in zip(placeholders, signature.inputs) if s.kind == "param"}
    tables = {n.args[0]: (_shape(n.args[0]) or (0,))[0] for n in gm.graph.nodes
              if n.target == aten.embedding.default and n.args[0] in names}
    if not tables:
        return
    # The vocabulary is the largest table (positions and token types are small ones).
    table, rows = max(tables.items(), key=lambda kv: kv[1])
    if rows > 1 and rows % T:
        padded = -(-rows // (64 * T)) * 64 * T
        warn_user(f"Config.tensor={T}: the embedding {names[table]} has {rows} rows (the vocabulary), which "
                  f"do not split over {T} ranks, so it cannot be vocabulary-parallel and stays whole or is "
                  f"split on its hidden dim (gathered for the head each step); pad the vocabulary to a "
                  f"multiple of {T}, e.g. {padded} (Hugging Face: model.resize_token_embeddings({rows}, "
                  f"pad_to_multiple_of={64 * T}))", ConfigWarning)


def _kv_heads(k: fx.Node, heads: int) -> int:
    """Key/value heads before grouped-query attention repeated them (Llama's repeat_kv:
    [B, kv, S, hd] -> expand [B, kv, n_rep, S, hd] -> reshape [B, kv * n_rep, S, hd])."""
    for _ in range(8):
        if not isinstance(k, fx.Node) or k.op != "call_function":
            break
        if k.target == aten.expand.default:
            src = _shape(k.args[0])
            return src[1] if src is not None and len(src) == 5 else heads
        if k.target not in (*_VIEWS, aten.clone.default, aten.unsqueeze.default, aten._to_copy.default):
            break
        k = k.args[0]
    return heads


TP_PLAN_NOTE = ("tensor parallel: memory and time above are tp rank 0's program (its slices of the sharded weights, "
                "its share of the activations, the tp collectives); tp_placements is the chosen layout")


def make_placement_analysis(devices: Sequence[DeviceSpec]) -> Any:
    """The "tp_placements" graph pass of a new PlacementAnalysis (see there)."""
    return PlacementAnalysis(devices).graph_pass


__all__ = ["P", "PS", "PARAMS_KEY", "group_sizes", "TP_PLAN_NOTE", "Placement", "PlacementAnalysis", "NodePlacement", "R", "S", "TP_KEY", "WHOLE",
           "warn_heads", "DRAW_WHOLE", "check_tensor_config", "collapse_blocks", "warn_vocabulary", "describe_placements", "make_placement_analysis",
           "propagate", "reshape_placement", "solve"]


def describe_placements(gm: fx.GraphModule, signature: Any, group: str | None = None
                        ) -> tuple[dict[str, str], dict[str, int]]:
    """For plan.tp_placements / tp_communication: every parameter's placement (by name) in the
    program `gm` (after the tp_placements analysis; under ZeRO-3 the parameters are bucket shards,
    named by the buckets) and the tp collective bytes per step, counted from the functional
    collectives shard_tensors put in the graph (bytes of each result; `group`: only those on the
    tp group of that name, where data-parallel collectives are functional collectives too)."""
    chosen = gm.meta.get(PARAMS_KEY, {})
    names = [s.target for s in signature.inputs if s.kind in ("param", "param_tp")]
    names += [n for b in signature.buckets for n in b.names if n not in names]
    def shown(n: str) -> Placement:
        p = chosen.get(n, R)
        # WHOLE, and a split over one group of all ranks (MQA's k/v weights): held whole
        return R if p == WHOLE or p.kind == "S" and p.rep > 1 and n not in signature.tp_layout else p

    placements = {n: str(shown(n)) for n in names}
    comm: dict[str, int] = {}
    for kind, nbytes in tp_collectives(gm, group):
        comm[f"tp_{kind}"] = comm.get(f"tp_{kind}", 0) + nbytes
    return placements, comm


def tp_collectives(gm: fx.GraphModule, group: str | None = None) -> list[tuple[str, int]]:
    """The tp collectives shard_tensors put in `gm`, in graph order: ("all_reduce", "all_gather"
    or "reduce_scatter", bytes of the result); with `group`, only those on that group (its name is
    each collective's last argument)."""
    c10d = torch.ops._c10d_functional
    kinds = {c10d.all_reduce.default: "all_reduce", c10d.all_gather_into_tensor.default: "all_gather",
             c10d.reduce_scatter_tensor.default: "reduce_scatter"}
    out = []
    for n in gm.graph.nodes:
        if n.target in kinds and (group is None or n.args[-1] == group):  # (not via _nbytes' cache: one solve)
            v = n.meta.get("val")
            out.append((kinds[n.target], int(v.numel()) * v.element_size() if isinstance(v, torch.Tensor) else 0))
    return out


def check_tensor_config(config: Any, n_devices: int) -> None:
    """Config.tensor against the device count: devices = pipeline x tensor x replicas (tensor x
    data parallelism, any ZeRO stage)."""
    T, pp = config.tensor, config.pipeline
    if n_devices % (T * pp):
        raise ConfigError(f"Config.tensor={T} (x pipeline={pp}) does not divide the {n_devices} devices: the devices "
                          f"must be a multiple of pipeline x tensor = {T * pp}; use devices="
                          f"{max(1, n_devices // (T * pp)) * T * pp} or a tensor that divides {n_devices // pp}")
