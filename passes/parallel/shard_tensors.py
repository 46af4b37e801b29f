"""shard_tensors: rewrite the joint graph for this tensor-parallel rank, as the placements say.

The placements come from the "tp_placements" analysis (fxspeed/planner/placement.py, handed
in by the engine): every node's output placement and the placement each of its inputs must
have. This pass applies them:

    before (one device):                          after (rank t of T, Megatron MLP):
      w1: f32[4D, D]   w2: f32[D, 4D]               w1: f32[4D/T, D]  (param_tp, S(0))
      h  = mm(x, t(w1))          [B, 4D]            w2: f32[D, 4D/T]  (param_tp, S(1))
      a  = gelu(h)                                  h  = mm(x, t(w1))             [B, 4D/T]
      y  = mm(a, t(w2))          [B, D]             a  = gelu(h)
      ...                                           y_ = mm(a, t(w2))             [B, D] partial
                                                    y  = wait_tensor(all_reduce(y_, "sum", tp))
      return (loss, g_w1, g_w2)                     return (loss, g_w1 [4D/T, D], g_w2 [D, 4D/T])

- A sharded parameter input becomes this rank's slice: its IOSpec kind is "param_tp" and
  `signature.tp_layout[name] = (dim, blocks)` says which slice (blocks: see Placement).
- Ops run on local shapes: size arguments of views/expands and split sizes are rewritten to
  the local shape (the head count of `view(x, [B, S, H, hd])` becomes H/T); every rewritten
  node's shape is checked against the placement, and a mismatch is an error, never a guess.
- Where a value's placement differs from what a reader needs, a collective is inserted
  (functional collectives over `options.tp_group_name`, each followed by wait_tensor):
  P -> R all_reduce, S -> R all_gather_into_tensor (+ reorder for dims other than 0 and
  blocked shards), R -> S a local slice (no communication); P -> S is an all-reduce then a
  slice (gloo has no reduce-scatter worth using), except under sequence parallelism
  (options.sequence_parallel), where it is a reduce_scatter_tensor along the shard's dim (the
  token shard of the residual stream). Each conversion is made once per value.
- Shards held by groups of ranks (S with rep r > 1: piece t // r on rank t; grouped-query
  attention's k/v weights when there are fewer key/value heads than ranks): a parameter so placed
  is a "param_tp" input with `tp_layout[name] = (dim, (blocks, r))` (a split over one group of
  all T ranks, MQA's, is the whole tensor: a plain "param"). S(r) -> S(r') with r' dividing r is
  a local slice; a group partial sum PS (layout of S(r), value summed over each group's ranks)
  comes from S(1) by zero-padding each rank's piece into its group's, becomes P by zero-padding
  to the whole shape, and R or S by one all-reduce of that padded value (T / r times the bytes
  of a reduce over the group alone, but no process group of its own). S(r) -> R all-gathers
  and keeps one copy of each piece.
- addmm whose product is a partial sum (row-parallel with a bias) becomes mm, all-reduce, add
  (sequence parallel: mm, reduce-scatter by rows, add).
- Gradients come out in their parameter's placement (the local slice's gradient).

Options read: tp_size, tp_rank, tp_group_name, sequence_parallel. Does nothing when tp_size is 1.
"""

from __future__ import annotations

import operator
from typing import Any, Callable

import torch
import torch.fx as fx

from fxspeed.compiler.pass_manager import PassContext, PassResult, graph_pass
from fxspeed.compiler.rewrite import call, fake_value, gather_root, view_path
from fxspeed.errors import ConfigError, PassError
from fxspeed.ir import IOSpec

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
TP_KEY = "fxspeed_tp"          # written by the tp_placements analysis (fxspeed/planner/placement.py)
PARAMS_KEY = "fxspeed_tp_params"

_SIZE_ARG = {aten.view.default: 1, aten._unsafe_view.default: 1, aten.reshape.default: 1, aten.expand.default: 1,
             aten.slice_backward.default: 1}


def local_shape(shape: tuple[int, ...], p: Any, T: int) -> tuple[int, ...]:
    if getattr(p, "kind", "R") not in ("S", "PS"):
        return tuple(shape)
    s = list(shape)
    s[p.dim] //= T // getattr(p, "rep", 1)
    return tuple(s)


def _rep(p: Any) -> int:
    return getattr(p, "rep", 1)


@graph_pass("shard_tensors", requires=("annotate", "tp_placements"), invalidates=("annotate",))
def shard_tensors(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    opts = ctx.options
    T = opts.tp_size
    if T == 1:
        return PassResult(gm, modified=False)
    if not opts.tp_group_name:
        raise ConfigError(f"pass 'shard_tensors' emits collectives over {T} tensor-parallel ranks but "
                          "PassOptions.tp_group_name is empty; derive the options from the mesh (derive_options)")
    group, rank = opts.tp_group_name, opts.tp_rank
    sequence_parallel = opts.sequence_parallel
    sig = ctx.signature
    params = gm.meta.get(PARAMS_KEY, {})
    old = gm.graph
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    place: dict[fx.Node, Any] = {}
    cache: dict[tuple[fx.Node, Any], fx.Node] = {}

    def pl(n: fx.Node) -> Any:
        npl = n.meta.get(TP_KEY)
        if npl is None:
            raise PassError(f"shard_tensors: node {n.name!r} has no placement; the tp_placements analysis must run "
                            "on the graph this pass rewrites")
        return npl.out

    def reduce(x: fx.Node) -> fx.Node:
        return call(g, c10d.wait_tensor.default, (call(g, c10d.all_reduce.default, (x, "sum", group)),))

    def along(x: fx.Node, dim: int, nd: int, collective: Callable[[fx.Node, list[int]], fx.Node]) -> fx.Node:
        """`collective` (node -> node, over dim 0) applied along `dim` of `x` (`nd` dims): `dim`
        permuted to the front and made contiguous, the collective, and permuted back."""
        order = [dim, *[i for i in range(nd) if i != dim]]
        y = x if dim == 0 else call(g, aten.permute.default, (x, order))
        y = call(g, aten.clone.default, (y,), {"memory_format": torch.contiguous_format})
        y = collective(y, order)
        if dim != 0:
            y = call(g, aten.permute.default, (y, [order.index(i) for i in range(nd)]))
            y = call(g, aten.clone.default, (y,), {"memory_format": torch.contiguous_format})
        return y

    def reduce_scatter(x: fx.Node, dim: int) -> fx.Node:
        """Sequence parallelism: this rank's piece along `dim` of the sum of partial sums `x`."""
        return along(x, dim, x.meta["val"].dim(), lambda y, order: call(
            g, c10d.wait_tensor.default, (call(g, c10d.reduce_scatter_tensor.default, (y, "sum", T, group)),)))

    def take(x: fx.Node, shape: tuple[int, ...], p: Any) -> fx.Node:
        """This rank's slice of a full tensor `x` (global `shape`) placed `p` (piece rank // rep)."""
        return _cut(g, x, p.dim, p.blocks, shape[p.dim] // p.blocks, T // _rep(p), rank // _rep(p))

    def gather(x: fx.Node, shape: tuple[int, ...], p: Any) -> fx.Node:
        """The full tensor (global `shape`) from this rank's slice `x` placed `p`."""
        d, b, r = p.dim, p.blocks, _rep(p)
        n = T // r  # distinct pieces; ranks k*r .. k*r+r-1 hold piece k

        def all_gather(y: fx.Node, order: list[int]) -> fx.Node:
            full = call(g, c10d.wait_tensor.default, (call(g, c10d.all_gather_into_tensor.default, (y, T, group)),))
            rest = [shape[i] for i in order[1:]]
            m = shape[d] // (b * n)
            if r > 1:  # one copy of each piece: [n, r, b * m, ...] -> [n, b * m, ...]
                full = call(g, aten.reshape.default, (full, [n, r, b * m, *rest]))
                full = call(g, aten.select.int, (full, 1, 0))
            if b > 1:  # [n, b, m, ...] -> [b, n, m, ...]: block-major, as the full dim is laid out
                full = call(g, aten.reshape.default, (full, [n, b, m, *rest]))
                full = call(g, aten.permute.default, (full, [1, 0, *range(2, len(rest) + 3)]))
            if r > 1 or b > 1:
                full = call(g, aten.reshape.default, (full, [shape[d], *rest]))
            return full

        return along(x, d, len(shape), all_gather)

    def pad(x: fx.Node, p: Any, size: int, pieces: int, index: int) -> fx.Node:
        """`x` (dim p.dim: p.blocks blocks) zero-padded so that each block becomes `size` long,
        x's part of it at piece `index` of `pieces`."""
        return _pad(g, x, p.dim, p.blocks, size, pieces, index)

    full_of: dict[fx.Node, fx.Node] = {}  # old node -> its whole value, where one was gathered

    def regathered(src: fx.Node) -> fx.Node | None:
        """`src`'s whole value as views of a value already gathered whole (a gradient gathered for
        the input-gradient matmul, read transposed by the weight-gradient one), else None."""
        path = view_path(src, full_of)
        if path is None:
            return None
        for base, v in zip(path, path[1:]):  # each view not made yet, from the gathered value on
            # reshape, not view: the gathered base is contiguous in its own shape, where the
            # traced one may not have been (attention's output, laid out [B, S, H, hd] under
            # its [B, H, S, hd] shape, is viewed after a transpose)
            op = aten.reshape.default if v.target in (aten.view.default, aten._unsafe_view.default) else v.target
            full_of[v] = call(g, op, (full_of[base], *v.args[1:]), dict(v.kwargs))
        return full_of[src]

    def convert(src_node: fx.Node, want: Any) -> fx.Node:
        x = env[src_node]
        have = place[src_node]
        if have == want or (getattr(want, "kind", "R") == "R" and getattr(have, "kind", "R") == "R"):
            return x
        if have.kind == "S" and _rep(have) >= T and want.kind == "R":
            return x  # one group of all ranks: every rank holds the whole value
        key = (src_node, want)
        if key in cache:
            return cache[key]
        shape = tuple(int(s) for s in src_node.meta["val"].shape)
        val = src_node.meta["val"]
        local = (have.kind in ("S", "PS") and want.kind in ("S", "PS") and (have.dim, have.blocks) ==
                 (want.dim, want.blocks))
        per_block = shape[want.dim] // want.blocks if want.kind in ("S", "PS") else 0
        if local and have.kind == "S" and want.kind == "S" and _rep(have) % _rep(want) == 0:
            # a finer shard: this rank's part of its group's piece (a group's key/value heads ->
            # those of this rank's query heads)
            k = _rep(have) // _rep(want)
            y = _cut(g, x, want.dim, want.blocks, per_block // (T // _rep(have)), k, (rank % _rep(have)) // _rep(want))
        elif local and have.kind == "S" and _rep(have) == 1 and want.kind == "PS":
            # this rank's piece zero-padded into its group's: a partial sum over the group
            r = _rep(want)
            y = pad(x, want, per_block // (T // r), r, rank % r)
        elif have.kind == "PS" and want.kind == "P":
            r = _rep(have)
            y = pad(x, have, shape[have.dim] // have.blocks, T // r, rank // r)
        elif want.kind in ("P", "PS"):
            raise PassError(f"shard_tensors: node {src_node.name!r} ({have}) would have to become {want}; "
                            "the placements are inconsistent")
        else:
            y = None
        if y is not None:
            y = _in_layout_of(g, y, val)
            cache[key] = y
            return y
        if have.kind == "P" and want.kind == "S" and sequence_parallel and want.blocks == 1 and _rep(want) == 1:
            cache[key] = y = reduce_scatter(x, want.dim)
            return y
        if have.kind == "PS":
            # zero-padded to the whole shape, all-reduced over the tp group: every group's pieces
            # summed over its ranks, the others' zeros; the whole value on every rank
            r = _rep(have)
            y = reduce(pad(x, have, shape[have.dim] // have.blocks, T // r, rank // r))
        elif have.kind == "P":
            y = reduce(x)
        elif have.kind == "S":
            y = regathered(src_node)
            if y is None:
                # gather the first sharded value of its view chain: the q, k and v projections'
                # own views of one normed activation then share one all-gather
                base = gather_root(src_node, lambda v: getattr(place.get(v), "kind", "R") == "S")
                full_of[base] = gather(env[base], tuple(int(d) for d in base.meta["val"].shape), place[base])
                y = regathered(src_node)
        else:
            y = x
        # Laid out as traced (a gathered value is contiguous in its own shape, a slice is cloned
        # contiguous): the nodes after it kept their traced values, and an op's real output strides
        # follow its inputs' (CPU attention's output follows the query's layout), so a view
        # traced on them would not fit another layout.
        y = _in_layout_of(g, y, val)
        if want.kind == "S":
            y = _in_layout_of(g, take(y, shape, want), val)
        cache[key] = y
        return y

    placeholders = [n for n in old.nodes if n.op == "placeholder"]
    spec_of = dict(zip(placeholders, sig.inputs))
    new_inputs = list(sig.inputs)
    layout: dict[str, tuple[int, int]] = {}
    # annotate reads a forward node's module by its name (ctx.module_of, from the capture), but
    # the nodes of `g` take new names, some of them other nodes' old ones: each module came back
    # on the wrong nodes (under tp a Llama's layer-1 norm and q projection read as layer 0's,
    # and the eval program's pipeline cut left layer 1's q_proj on stage 0, which had freed it).
    # Every node made for an old node takes its module.
    modules: dict[str, str] = {}
    made_for: tuple[fx.Node, fx.Node | None] | None = None  # (old node, g's last node before it)

    def take_module() -> None:
        if made_for is None or made_for[0].name not in ctx.module_of:
            return
        for m in reversed(g.nodes):  # the nodes made for it were appended after `made_for[1]`
            if m is made_for[1]:
                break
            modules[m.name] = ctx.module_of[made_for[0].name]

    for n in list(old.nodes):
        take_module()
        made_for = (n, next(reversed(g.nodes), None))
        if n.op == "placeholder":
            new = g.placeholder(n.name)
            new.meta.update({k: v for k, v in n.meta.items() if k not in (TP_KEY, "fxspeed")})
            spec = spec_of[n]
            p = params.get(spec.target) if spec.kind == "param" else None
            if p is not None and p.kind == "S" and _rep(p) >= T:
                place[n] = p  # split over one group of all ranks: the whole tensor, a plain input
            elif p is not None and p.kind == "S":
                v = n.meta["val"]
                new.meta["val"] = fake_value(aten.empty.memory_format, (list(local_shape(v.shape, p, T)),),
                                             {"dtype": v.dtype, "device": v.device})
                new_inputs[placeholders.index(n)] = IOSpec("param_tp", spec.target)
                layout[spec.target] = (p.dim, p.blocks) if _rep(p) == 1 else (p.dim, (p.blocks, _rep(p)))
                place[n] = p
            else:
                place[n] = _R
            env[n] = new
            continue
        if n.op == "output":
            npl = n.meta[TP_KEY]
            outs = list(n.args[0])
            k = 0
            new_outs = []
            for o in outs:
                if isinstance(o, fx.Node):
                    new_outs.append(convert(o, npl.want[k]))
                    k += 1
                else:
                    new_outs.append(o)
            out = g.output(tuple(new_outs))
            out.meta.update({k2: v for k2, v in n.meta.items() if k2 not in (TP_KEY, "fxspeed")})
            continue
        if n.op == "get_attr":  # a constant the trace baked in: replicated
            new = g.get_attr(n.target)
            new.meta.update({k: v for k, v in n.meta.items() if k not in (TP_KEY, "fxspeed")})
            env[n], place[n] = new, _R
            continue
        if n.op != "call_function":
            raise PassError(f"shard_tensors: node {n.name!r} ({n.op}) is not a call; only ATen graphs are sharded")
        npl = n.meta.get(TP_KEY)
        if npl is None:
            raise PassError(f"shard_tensors: node {n.name!r} has no placement; run the tp_placements analysis first")
        if n.target is operator.getitem and isinstance(env[n.args[0]], tuple):
            env[n], place[n] = env[n.args[0]][n.args[1]], npl.out  # a rewrite made each result apart
            continue
        if n.target is operator.getitem:
            new = g.call_function(operator.getitem, (env[n.args[0]], n.args[1]))
            new.meta["val"] = env[n.args[0]].meta["val"][n.args[1]]
            new._rename(n.name)  # its old name unless a rewrite's node took it
        else:
            wants = iter(npl.want)
            args, kwargs = fx.node.map_arg((n.args, n.kwargs), lambda a: convert(a, next(wants)))
            args = list(args) if npl.rewrite else _local_args(n, list(args), npl, T)
            if npl.rewrite:
                new = _REWRITES[npl.rewrite][n.target](_Emit(g, group, rank, T), n, args, kwargs)
                if isinstance(new, tuple):
                    env[n], place[n] = new, npl.out
                    continue
            elif npl.reduce_before_bias:
                prod = call(g, aten.mm.default, (args[1], args[2]))
                summed = reduce_scatter(prod, 0) if getattr(npl.out, "kind", "R") == "S" else reduce(prod)
                new = call(g, aten.add.Tensor, (summed, args[0]))
            elif _all_global(npl):
                # Same shapes as before: reuse the traced value instead of running the op on fakes.
                new = g.call_function(n.target, tuple(args), kwargs)
                new.meta["val"] = n.meta["val"]
            else:
                new = call(g, _viewable(n.target, tuple(args), kwargs), tuple(args), kwargs)
        for k, v in n.meta.items():
            if k not in ("val", TP_KEY, "fxspeed"):
                new.meta[k] = v
        _check_shape(n, new, npl.out, T)
        env[n] = new
        place[n] = npl.out
    take_module()
    ctx.module_of.clear()
    ctx.module_of.update(modules)
    gm.graph = g
    gm.recompile()
    sig.inputs = new_inputs
    sig.tp_layout = layout
    return PassResult(gm, modified=True)


class _Emit:
    """Appends the nodes of a vocabulary-parallel rewrite to `g` (this rank: `rank` of `T`)."""

    def __init__(self, g: fx.Graph, group: str, rank: int, T: int):
        self.g, self.group, self.rank, self.T = g, group, rank, T

    def __call__(self, op: Any, *args: Any, **kwargs: Any) -> fx.Node:
        return call(self.g, op, args, kwargs)

    def all_reduce(self, x: fx.Node, how: str = "sum") -> fx.Node:
        return self(c10d.wait_tensor.default, self(c10d.all_reduce.default, x, how, self.group))

    def local_targets(self, target: fx.Node, lp: fx.Node, ignore: int) -> tuple[fx.Node, int]:
        """Targets into this rank's columns of the log-probabilities `lp`, another rank's targets
        turned into the ignore index shifted like them (so ignored here); and that index."""
        rows = int(lp.meta["val"].shape[1])
        shifted = ignore - self.rank * rows
        return self.local_ids(target, rows, shifted)[0], shifted

    def local_ids(self, ids: fx.Node, rows: int, fill: int) -> tuple[fx.Node, fx.Node]:
        """Ids into this rank's `rows` of the vocabulary (rank * rows onward), `fill` where an id
        is another rank's; and the mask of those."""
        local = self(aten.sub.Tensor, ids, self.rank * rows)
        other = self(aten.bitwise_or.Tensor, self(aten.lt.Scalar, local, 0), self(aten.ge.Scalar, local, rows))
        return self(aten.masked_fill.Scalar, local, other, fill), other


def _vocab_embedding(e: _Emit, n: fx.Node, args: list[Any], kwargs: dict[str, Any]) -> fx.Node:
    """embedding(W[V/T rows], ids) -> the rows this rank holds, zeros for the others' ids: a partial sum."""
    w, ids = args[0], args[1]
    local, other = e.local_ids(ids, int(w.meta["val"].shape[0]), 0)
    return e(aten.masked_fill.Scalar, e(aten.embedding.default, w, local), e(aten.unsqueeze.default, other, -1), 0)


def _vocab_embedding_backward(e: _Emit, n: fx.Node, args: list[Any], kwargs: dict[str, Any]) -> fx.Node:
    """The gradient of this rank's rows: the others' ids land on row 0 with a zeroed gradient."""
    grad, ids, num_weights, padding_idx = args[:4]
    rows = num_weights // e.T
    local, other = e.local_ids(ids, rows, 0)
    grad = e(aten.masked_fill.Scalar, grad, e(aten.unsqueeze.default, other, -1), 0)
    pad = padding_idx - e.rank * rows if padding_idx >= 0 and 0 <= padding_idx - e.rank * rows < rows else -1
    return e(aten.embedding_dense_backward.default, grad, local, rows, pad, False)


def _vocab_log_softmax(e: _Emit, n: fx.Node, args: list[Any], kwargs: dict[str, Any]) -> fx.Node:
    """log_softmax over a dim split across ranks: x - max - log(sum(exp(x - max))), the row max and
    the row sum all-reduced."""
    x, dim, half_to_float = args[0], args[1], args[2] if len(args) > 2 else False
    if half_to_float:
        x = e(aten._to_copy.default, x, dtype=torch.float32)
    top = e.all_reduce(e(aten.amax.default, x, [dim], True), "max")
    z = e(aten.sub.Tensor, x, top)
    total = e.all_reduce(e(aten.sum.dim_IntList, e(aten.exp.default, z), [dim], True))
    return e(aten.sub.Tensor, z, e(aten.log.default, total))


def _vocab_log_softmax_backward(e: _Emit, n: fx.Node, args: list[Any], kwargs: dict[str, Any]) -> fx.Node:
    """grad - exp(out) * sum(grad) with the row sum all-reduced."""
    grad, out, dim, dtype = args[:4]
    total = e.all_reduce(e(aten.sum.dim_IntList, grad, [dim], True))
    r = e(aten.sub.Tensor, grad, e(aten.mul.Tensor, e(aten.exp.default, out), total))
    return r if r.meta["val"].dtype == dtype else e(aten._to_copy.default, r, dtype=dtype)


def _vocab_nll_loss(e: _Emit, n: fx.Node, args: list[Any], kwargs: dict[str, Any]) -> tuple[fx.Node, fx.Node]:
    """(loss, total weight): this rank's picked log-probabilities (a partial sum); the total weight
    (targets not ignored) counted from the whole target, so a mean divides by the global count.
    Another rank's targets become the ignore index shifted like the ids: ignored here."""
    lp, target, _weight, reduction, ignore = args[:5]
    local, shifted = e.local_targets(target, lp, ignore)
    picked = e(aten.nll_loss_forward.default, lp, local, None, 0 if reduction == 0 else 2, shifted)
    loss = e(operator.getitem, picked, 0)
    if reduction == 0:
        return loss, e(operator.getitem, picked, 1)
    count = e(aten.sum.default, e(aten.ne.Scalar, target, ignore))
    total = e(aten._to_copy.default, count, dtype=lp.meta["val"].dtype)
    return (e(aten.div.Tensor, loss, total) if reduction == 1 else loss), total


def _vocab_nll_loss_backward(e: _Emit, n: fx.Node, args: list[Any], kwargs: dict[str, Any]) -> fx.Node:
    grad, lp, target, weight, reduction, ignore, total = args[:7]
    local, shifted = e.local_targets(target, lp, ignore)
    return e(aten.nll_loss_backward.default, grad, lp, local, weight, reduction, shifted, total)


_VOCAB_REWRITES = {aten.embedding.default: _vocab_embedding,
                   aten.embedding_dense_backward.default: _vocab_embedding_backward,
                   aten._log_softmax.default: _vocab_log_softmax,
                   aten._log_softmax_backward_data.default: _vocab_log_softmax_backward,
                   aten.nll_loss_forward.default: _vocab_nll_loss,
                   aten.nll_loss_backward.default: _vocab_nll_loss_backward}


def _dropout_drawn_whole(e: _Emit, n: fx.Node, args: list[Any], kwargs: dict[str, Any]) -> tuple[fx.Node, fx.Node]:
    """Dropout of this rank's piece of x, with the mask one device would draw for the whole x
    (every rank draws all of it and keeps its piece; the generators stay equal):

        before:  out, mask = native_dropout(x [B, H/T, S, S], p, train)   # a mask of its own
        after:   out_w, mask_w = native_dropout(pad(x) [B, H, S, S], p, train)
                 out, mask = cut(out_w), cut(mask_w)                     # piece t of each

    Zeros pad the other pieces: the kept piece of `out_w` is computed by the same op as on one
    device, so it is bit for bit eager's on any device and dtype."""
    p = n.meta[TP_KEY].want[0]
    v = n.args[0].meta["val"]
    size = int(v.shape[p.dim]) // p.blocks
    pieces, index = e.T // _rep(p), e.rank // _rep(p)
    whole = _in_layout_of(e.g, _pad(e.g, args[0], p.dim, p.blocks, size, pieces, index), v)
    drawn = e(aten.native_dropout.default, whole, *args[1:], **kwargs)
    return tuple(_in_layout_of(e.g, _cut(e.g, e(operator.getitem, drawn, i), p.dim, p.blocks, size, pieces, index),
                               n.meta["val"][i]) for i in range(2))


# Placement.rewrite -> op -> rewrite (fxspeed/planner/placement.py: VOCAB, DRAW_WHOLE)
_REWRITES = {"vocab": _VOCAB_REWRITES, "draw_whole": {aten.native_dropout.default: _dropout_drawn_whole}}


class _Replicated:
    kind = "R"


_R = _Replicated()


def _all_global(npl: Any) -> bool:
    outs = npl.out if isinstance(npl.out, tuple) else (npl.out,)
    return all(getattr(p, "kind", "R") not in ("S", "PS") for p in (*outs, *npl.want))


def _cut(g: fx.Graph, x: fx.Node, dim: int, blocks: int, size: int, pieces: int, index: int) -> fx.Node:
    """Piece `index` of `pieces` of each of the `blocks` blocks (each `size` long) of `x`'s dim
    `dim`, concatenated; a contiguous copy."""
    m = size // pieces
    parts = [call(g, aten.slice.Tensor, (x, dim, k * size + index * m, k * size + (index + 1) * m))
             for k in range(blocks)]
    y = parts[0] if len(parts) == 1 else call(g, aten.cat.default, (parts, dim))
    return call(g, aten.clone.default, (y,), {"memory_format": torch.contiguous_format})


def _pad(g: fx.Graph, x: fx.Node, dim: int, blocks: int, size: int, pieces: int, index: int) -> fx.Node:
    """The inverse of _cut with zeros elsewhere: `x` holds piece `index` of `pieces` of each of
    `blocks` blocks along `dim`; the result has blocks of `size`, zero outside those pieces."""
    if pieces == 1:
        return x
    nd = x.meta["val"].dim()
    m = size // pieces
    parts = [x] if blocks == 1 else [call(g, aten.slice.Tensor, (x, dim, k * m, (k + 1) * m)) for k in range(blocks)]
    widths = [0, 0] * (nd - 1 - dim) + [index * m, size - (index + 1) * m]
    parts = [call(g, aten.constant_pad_nd.default, (y, widths, 0.0)) for y in parts]
    return parts[0] if len(parts) == 1 else call(g, aten.cat.default, (parts, dim))


def _memory_order(v: torch.Tensor) -> list[int]:
    """Dims from outermost to innermost in memory. Dims of size 1 or stride 0 (an expand's
    broadcast: GQA's repeated key/value heads) have no place in memory of their own: they go
    where a contiguous tensor has them, never innermost (with an expanded head dim ordered
    innermost, CPU flash attention read a value whose last dim had stride 4 and returned garbage)."""
    free = [i for i in range(v.dim()) if v.shape[i] == 1 or v.stride(i) == 0]
    order = sorted((i for i in range(v.dim()) if i not in free), key=lambda i: -v.stride(i))
    for f in free:
        later = [k for k, d in enumerate(order) if d > f]
        order.insert(later[0] if later else len(order), f)
    return order


def _in_layout_of(g: fx.Graph, y: fx.Node, like: torch.Tensor) -> fx.Node:
    """`y` (any shape of `like`'s rank) with `like`'s memory order, copied only if it differs:

        before:  y [B, H, S, hd] contiguous        like: [B, H, S, hd] laid out as [B, S, H, hd]
        after:   permute(clone(permute(y, [0, 2, 1, 3])), [0, 2, 1, 3])"""
    have = y.meta.get("val")
    if not isinstance(have, torch.Tensor) or have.dim() != like.dim() or have.dim() < 2:
        return y
    order = _memory_order(like)
    fixed = [d for d in order if like.shape[d] != 1 and like.stride(d) != 0]
    if [d for d in _memory_order(have) if d in fixed] == fixed or have.is_contiguous() and like.is_contiguous():
        return y
    inverse = [order.index(i) for i in range(len(order))]
    y = call(g, aten.permute.default, (y, order))
    y = call(g, aten.clone.default, (y,), {"memory_format": torch.contiguous_format})
    return call(g, aten.permute.default, (y, inverse))


def _viewable(target: Any, args: tuple, kwargs: dict) -> Any:
    """`target`, or reshape for a view the rewritten input's strides do not allow (the traced value
    was laid out so that it could be viewed; a sharded or gathered one may not be, e.g. attention's
    output transposed back to [B, S, heads, hd]). Same values: the graph is functional."""
    if target not in (aten.view.default, aten._unsafe_view.default):
        return target
    try:
        fake_value(target, args, kwargs)
    except (RuntimeError, ValueError):
        return aten.reshape.default
    return target


def _local_args(n: fx.Node, args: list[Any], npl: Any, T: int) -> list[Any]:
    """Size arguments rewritten to the local shape (views, expands, split sizes)."""
    t = n.target
    out = npl.out
    if t in _SIZE_ARG and getattr(out, "kind", "R") in ("S", "PS"):
        args[_SIZE_ARG[t]] = list(local_shape(tuple(n.meta["val"].shape), out, T))
    elif t in (aten.split.Tensor, aten.split_with_sizes.default) and isinstance(out, tuple):
        src = npl.want[0]
        nd = n.args[0].meta["val"].dim()
        dim = (n.args[2] if len(n.args) > 2 else 0) % nd
        if getattr(src, "kind", "R") == "S" and src.dim == dim:
            n = T // _rep(src)
            args[1] = [s // n for s in args[1]] if isinstance(args[1], (list, tuple)) else args[1] // n
    return args


def _check_shape(old: fx.Node, new: fx.Node, out: Any, T: int) -> None:
    ov, nv = old.meta.get("val"), new.meta.get("val")
    pairs = list(zip(ov, nv, out)) if isinstance(ov, (tuple, list)) and isinstance(out, tuple) else [(ov, nv, out)]
    for a, b, p in pairs:
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            want = local_shape(tuple(a.shape), p, T)
            if tuple(b.shape) != want:
                raise PassError(f"shard_tensors: {old.name} ({old.target}) came out {tuple(b.shape)} on this rank "
                                f"but its placement {p} needs {want}; please report this with the model")
