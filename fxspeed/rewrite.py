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
    # them as empty tensors of the same shape/stride/dtype under one fresh mode.
    with FakeTensorMode(allow_non_fake_inputs=True):
        vals = fx.node.map_arg((args, kwargs), lambda n: _like(n.meta["val"]))
        return target(*vals[0], **vals[1])


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
