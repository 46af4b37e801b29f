"""Helpers for passes that add nodes: every new node gets `meta["val"]` (a fake tensor), so
the verifier, the annotator and later passes see shapes and dtypes as on captured nodes."""

from __future__ import annotations

from typing import Any, Callable, Container

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode


def fake_value(target: Any, args: tuple, kwargs: dict | None = None) -> Any:
    """Run `target` on the fake values of its node arguments."""
    kwargs = kwargs or {}
    # Values in one graph may come from different fake modes (capture, earlier passes); re-create
    # them as empty tensors of the same shape/stride/dtype under our own mode.
    with _mode():
        vals = fx.node.map_arg((args, kwargs), lambda n: _like(n.meta["val"]))
        return target(*vals[0], **vals[1])


_MODE: FakeTensorMode | None = None


def _mode() -> FakeTensorMode:
    global _MODE
    if _MODE is None:  # one mode for all rewrites: creating a mode per node is slow
        _MODE = FakeTensorMode(allow_non_fake_inputs=True)
    return _MODE


def _like(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return torch.empty_strided(tuple(v.shape), tuple(v.stride()), dtype=v.dtype, device=v.device)
    return v


def call(graph: fx.Graph, target: Any, args: tuple, kwargs: dict | None = None, **meta: Any) -> fx.Node:
    """Create a call_function node at the graph's current insertion point, with meta['val']."""
    node = graph.call_function(target, args, kwargs or {})
    node.meta["val"] = fake_value(target, args, kwargs)
    node.meta.update(meta)
    return node


def wanted_on(gm: fx.GraphModule, mode: str) -> bool:
    """A device-dependent pass option ("always" | "cuda" | "off") read for this program: "cuda"
    holds when the program's tensors are on CUDA (its inputs' values, fake at capture, carry the
    model's device)."""
    if mode == "always":
        return True
    return mode == "cuda" and any(isinstance(v := n.meta.get("val"), torch.Tensor) and v.device.type == "cuda"
                                  for n in gm.graph.nodes if n.op == "placeholder")


def output_node(gm: fx.GraphModule) -> fx.Node:
    return next(n for n in reversed(gm.graph.nodes) if n.op == "output")


def scale_backward_seed(gm: fx.GraphModule, signature: Any, factor: float | fx.Node) -> bool:
    """Multiply the gradient that seeds backward, d(loss)/d(loss) = 1, by `factor` (a number or
    a graph value): every gradient comes out scaled, the loss itself does not. Used to average
    over ranks (1/N, exact for powers of two) and for fp16 loss scaling. Returns False when the
    graph has no recognizable seed (`ones_like(loss)`)."""
    out = output_node(gm)
    losses = [a for a, s in zip(out.args[0], signature.outputs) if s.kind == "loss"]
    if len(losses) != 1:
        return False
    seeds = [u for u in losses[0].users if u.target == torch.ops.aten.ones_like.default]
    if len(seeds) != 1:
        return False
    seed = seeds[0]
    with gm.graph.inserting_after(seed if not isinstance(factor, fx.Node) else _later(seed, factor)):
        product = scaled = call(gm.graph, torch.ops.aten.mul.Tensor, (seed, factor))
    dtype = seed.meta["val"].dtype
    if product.meta["val"].dtype != dtype:
        # an fp16 loss (a half model) times the fp32 scale promotes to fp32, where backward's
        # first op wants the loss's dtype; rounded back, as eager's GradScaler seed is
        with gm.graph.inserting_after(product):
            scaled = call(gm.graph, torch.ops.prims.convert_element_type.default, (product, dtype))
    seed.replace_all_uses_with(scaled, delete_user_cb=lambda u: u is not product)
    return True


def _later(a: fx.Node, b: fx.Node) -> fx.Node:
    for n in a.graph.nodes:
        if n is a:
            return b
        if n is b:
            return a
    return a


def cast_only_dtype(placeholder: fx.Node) -> torch.dtype | None:
    """The dtype a parameter is used in when its only reader is one cast (`insert_casts` made
    it): then it can travel in that dtype (ZeRO-3 gathers half the bytes under bf16)."""
    users = list(placeholder.users)
    if len(users) == 1 and users[0].target == torch.ops.aten._to_copy.default and \
            set(users[0].kwargs) == {"dtype"} and users[0].kwargs["dtype"] != placeholder.meta["val"].dtype:
        return users[0].kwargs["dtype"]
    return None


# --- view chains (tensor parallelism) --------------------------------------------------------
# The planner's cost model (fxspeed/planner/placement.py) and the pass that applies its
# placements (passes/parallel/shard_tensors.py) must agree on which value of a view chain is
# gathered whole and which readers reuse it; both walk the chains with these.

_aten = torch.ops.aten
# views whose gathered value is the view of their input's gathered value
VIEW_LIKE = {_aten.view.default, _aten._unsafe_view.default, _aten.reshape.default, _aten.t.default,
             _aten.transpose.int, _aten.permute.default}


def viewed(n: fx.Node) -> fx.Node | None:
    """The value `n` is a view of (one of VIEW_LIKE), else None."""
    if n.op == "call_function" and n.target in VIEW_LIKE and isinstance(n.args[0], fx.Node):
        return n.args[0]
    return None


def gather_root(n: fx.Node, sharded: Callable[[fx.Node], bool]) -> fx.Node:
    """The first sharded value of `n`'s view chain: `n` followed back through views as long as
    the viewed value is `sharded`. Gathering it whole (once) serves every view of it: the q, k
    and v projections' own views of one normed activation then share one all-gather."""
    while (src := viewed(n)) is not None and sharded(src):
        n = src
    return n


def view_path(n: fx.Node, values: Container[fx.Node]) -> list[fx.Node] | None:
    """The view chain from one of `values` to `n`, [that value, ..., n] (just [n] when `n` is one
    of them), or None when `n` is neither one of `values` nor a chain of views of one."""
    path = [n]
    while path[-1] not in values:
        src = viewed(path[-1])
        if src is None:
            return None
        path.append(src)
    path.reverse()
    return path
