"""Helpers for passes that add nodes: every new node gets `meta["val"]` (a fake tensor), so
the verifier, the annotator and later passes see shapes and dtypes as on captured nodes."""

from __future__ import annotations

from typing import Any

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
        scaled = call(gm.graph, torch.ops.aten.mul.Tensor, (seed, factor))
    seed.replace_all_uses_with(scaled, delete_user_cb=lambda u: u is not scaled)
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
