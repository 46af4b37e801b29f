"""chunk_cross_entropy: the vocabulary projection and its cross-entropy, forward and backward, as
one op that works on chunks of rows (runtime/kernels/cross_entropy.py), so the [N, V] logits,
log-probabilities and their gradient never exist.

    before:  logits = mm(h, wt)                     # h [N, C], wt [C, V] (W^T, maybe cast)
             lp = _log_softmax(view(logits), 1)
             loss, tw = nll_loss_forward(lp, target, None, reduction, ignore)
             ...
             g = nll_loss_backward(seed, lp, target, None, reduction, ignore, tw)
             d = view(_log_softmax_backward_data(g, lp, 1, f32))
             gw = mm(t(d), h)                       # [V, C]
             gh = mm(d, t(wt))                      # [N, C]
    after:   lce = fxspeed.linear_cross_entropy(h, wt, target, ignore, reduction, rows)
             loss = lce[0]
             ...
             gw = mul(lce[2], seed)
             gh = mul(lce[1], seed)

The gradients are computed in forward for a unit seed and scaled by the real one (a scalar: the
loss's upstream gradient, the fp16 loss scale included) where backward needs them. Casts between
the matmul and the softmax (mixed precision) and views are allowed on the way; anything else
reading the logits, the log-probabilities or the total weight (a model that also returns its
logits) leaves the graph as it is, as does a biased head (addmm) or a class-weighted loss.

When: options.chunk_cross_entropy "auto" chunks where the [N, V] fp32 logits would take at least
`options.chunk_cross_entropy_min_bytes` (small vocabularies gain nothing and keep the unfused
program's exact rounding), "always" everywhere, "off" never. Disabled by name too.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from fxspeed.compiler.pass_manager import PassContext, PassResult, graph_pass
from fxspeed.compiler.rewrite import call

aten = torch.ops.aten
_CASTS = (aten._to_copy.default, torch.ops.prims.convert_element_type.default)
_PASS_THROUGH = (aten.view.default, aten._unsafe_view.default, aten.reshape.default, *_CASTS)


def _through(n: fx.Node, up: bool) -> fx.Node:
    """Follow single-use views/casts up (to the producer) or down (to the consumer)."""
    while True:
        if up:
            if n.op == "call_function" and n.target in _PASS_THROUGH and isinstance(n.args[0], fx.Node) \
                    and len(n.args[0].users) == 1:
                n = n.args[0]
                continue
            return n
        users = list(n.users)
        if len(users) == 1 and users[0].op == "call_function" and users[0].target in _PASS_THROUGH:
            n = users[0]
            continue
        return n


def _is_t_of(n: Any, base: fx.Node) -> bool:
    return isinstance(n, fx.Node) and n.op == "call_function" and n.target in (aten.t.default, aten.permute.default) \
        and n.args[0] is base and (n.target is aten.t.default or list(n.args[1]) == [1, 0])


def _strip_casts(n: Any) -> Any:
    while isinstance(n, fx.Node) and n.op == "call_function" and n.target in _CASTS:
        n = n.args[0]
    return n


def find_sites(gm: fx.GraphModule) -> list[dict[str, fx.Node]]:
    """Every log_softmax + nll_loss over an mm whose pieces are read by nothing else."""
    sites = []
    for lsm in gm.graph.nodes:
        if lsm.op != "call_function" or lsm.target is not aten._log_softmax.default or lsm.args[1] not in (1, -1):
            continue
        site = _match(lsm)
        if site is not None:
            sites.append(site)
    return sites


def _match(lsm: fx.Node) -> dict[str, fx.Node] | None:
    users = {u.target: u for u in lsm.users if u.op == "call_function"}
    fwd, bwd, lsb = (users.get(aten.nll_loss_forward.default), users.get(aten.nll_loss_backward.default),
                     users.get(aten._log_softmax_backward_data.default))
    if len(lsm.users) != 3 or None in (fwd, bwd, lsb) or lsm.meta["val"].dim() != 2:
        return None
    _, target, weight, reduction, ignore = fwd.args[:5]
    if weight is not None or reduction not in (1, 2) or bwd.args[1] is not lsm or bwd.args[2] is not target \
            or bwd.args[3] is not None or lsb.args[0] is not bwd:
        return None
    outs = {u.args[1]: u for u in fwd.users if u.target is operator.getitem}
    if len(fwd.users) != 2 or set(outs) != {0, 1} or set(outs[1].users) != {bwd} or bwd.args[6] is not outs[1]:
        return None
    mm = _through(lsm.args[0], up=True)
    if mm.op != "call_function" or mm.target is not aten.mm.default or len(mm.users) != 1:
        return None
    h, wt = mm.args
    if h.meta["val"].dim() != 2 or wt.meta["val"].dim() != 2:
        return None
    d = _through(lsb, up=False)  # dlogits, 2-D
    if d.meta["val"].shape != lsm.meta["val"].shape:
        return None
    gw = gh = None
    for u in d.users:
        if u.target is aten.mm.default and u.args[0] is d and _is_t_of(_strip_casts(u.args[1]), _strip_casts(wt)) \
                or u.target is aten.mm.default and u.args[0] is d and _is_t_of(_strip_casts(wt), _strip_casts(u.args[1])):
            gh = u
        elif _is_t_of(u, d) and len(u.users) == 1:
            (m,) = u.users
            if m.target is aten.mm.default and m.args[0] is u and _strip_casts(m.args[1]) is _strip_casts(h):
                gw = m
    if gh is None or gw is None or len(d.users) != 2:
        return None
    return dict(mm=mm, h=h, wt=wt, lsm=lsm, fwd=fwd, loss=outs[0], bwd=bwd, seed=bwd.args[0], target=target,
                ignore=ignore, reduction=reduction, gw=gw, gh=gh)


def wanted(gm: fx.GraphModule, options: Any) -> bool:
    """Whether the pass has work under `options` (PassOptions): sites, large enough in "auto"."""
    mode = options.chunk_cross_entropy
    if mode == "off" or options.tp_size > 1:  # the tensor-parallel placement solver does not know the op yet
        return False
    # Read off the captured graph before normalize_graph (detach nodes still read the
    # log-probabilities there), so a cheap look; the pass matches exactly and may find nothing.
    floor = 0 if mode == "always" else options.chunk_cross_entropy_min_bytes
    return any(n.op == "call_function" and n.target is aten._log_softmax.default
               and any(u.target is aten.nll_loss_forward.default for u in n.users)
               and n.meta["val"].numel() * 4 >= floor for n in gm.graph.nodes)


@graph_pass("chunk_cross_entropy", invalidates=("annotate",))
def chunk_cross_entropy(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    from fxspeed.runtime.kernels.cross_entropy import rows_per_chunk  # registers fxspeed::linear_cross_entropy

    opts = ctx.options
    g = gm.graph
    changed = False
    for s in find_sites(gm):
        n, v = s["lsm"].meta["val"].shape
        if opts.chunk_cross_entropy == "auto" and n * v * 4 < opts.chunk_cross_entropy_min_bytes:
            continue
        with g.inserting_before(s["fwd"]):
            lce = call(g, torch.ops.fxspeed.linear_cross_entropy.default,
                       (s["h"], s["wt"], s["target"], int(s["ignore"]), int(s["reduction"]), rows_per_chunk(v)))
            loss = call(g, operator.getitem, (lce, 0))
        lce.meta.update({k: val for k, val in s["fwd"].meta.items() if k != "val"})
        if s["fwd"].name in ctx.module_of:
            ctx.module_of[lce.name] = ctx.module_of[loss.name] = ctx.module_of[s["fwd"].name]
        s["loss"].replace_all_uses_with(loss)
        for old, index in ((s["gh"], 1), (s["gw"], 2)):
            with g.inserting_before(old):
                grad = call(g, operator.getitem, (lce, index))
                scaled = call(g, aten.mul.Tensor, (grad, s["seed"]))
            scaled.meta.update({k: val for k, val in old.meta.items() if k != "val"})
            old.replace_all_uses_with(scaled)
        _erase_dead(g, [s["gh"], s["gw"], s["bwd"], s["loss"], s["fwd"], s["lsm"], s["mm"]])
        changed = True
    return PassResult(gm, modified=changed)


def _erase_dead(g: fx.Graph, roots: list[fx.Node]) -> None:
    """Erase the replaced nodes and whatever only they read (views, transposes, getitems)."""
    todo, erased = list(roots), set()
    while todo:
        n = todo.pop()
        if n in erased or n.users or n.op != "call_function":
            continue
        inputs = n.all_input_nodes
        g.erase_node(n)
        erased.add(n)
        todo += inputs
