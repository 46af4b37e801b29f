"""Checkpointed regions: which traced nodes ran inside `torch.utils.checkpoint`.

Under fxspeed's trace, `torch.utils.checkpoint.checkpoint` (use_reentrant True or False, and
so `checkpoint_sequential`, which calls it) runs the wrapped function directly, with none of
torch's checkpoint machinery, and every node the call adds to the traced graph is recorded
as belonging to one region. After capture the regions are written onto the captured graph as

    node.meta["recompute"] = region id     (an int; nested checkpoints join the outermost region)

and the `recompute_checkpointed` pass recomputes those regions in backward instead of
saving their values (why: docs/decisions/recompute-checkpointed.md).

How the call is intercepted. `from torch.utils.checkpoint import checkpoint` binds the
function object at the model's import time, so replacing the module attribute would miss it.
The function itself looks its helpers up in its module at call time: the reentrant variant
calls `CheckpointFunction.apply(function, preserve, *args)`, the non-reentrant variant
brackets `function(*args, **kwargs)` between two `next()`s of
`_checkpoint_without_reentrant_generator(...)`. Both are replaced while tracing (present
under these names in torch 2.1 through 2.13), so every spelling of the call is covered.

How the tags reach the graph. AOT export traces the joint function once with the model (the
graph the nodes are recorded in) and then re-executes that graph under a fresh `make_fx`,
which names nodes identically but drops their meta. So, as `capture._ModuleOwners` does for
module owners, nodes are recorded by name (for the last traced graph only) and written onto
the captured GraphModule by `tag`; a recorded name whose node has another target in the
final graph is not tagged (an untagged node is saved as before: never wrong, only less saving).

Reentrant checkpoint with no input requiring grad gives the region's parameters no gradient in
eager (torch warns about it); the direct call reproduces that by running the region under
`no_grad`.
"""

from __future__ import annotations

import contextlib
import itertools
from typing import Any, Callable, Iterator

import torch
import torch.fx as fx

RECOMPUTE_KEY = "recompute"


def _current_graph() -> fx.Graph | None:
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    mode = get_proxy_mode()
    return None if mode is None else mode.tracer.graph


class CheckpointRegions:
    """Context manager active during capture: intercepts checkpoint calls and records, per
    traced graph, node name -> (region id, target)."""

    def __init__(self) -> None:
        self.region: dict[str, tuple[int, Any]] = {}  # node name -> (region, target), last graph
        self._graph: fx.Graph | None = None
        self._ids = itertools.count()
        self._active: int | None = None  # the outermost open region
        self._stack: contextlib.ExitStack | None = None

    # -- patching -----------------------------------------------------------------------------
    def __enter__(self) -> "CheckpointRegions":
        import torch.utils.checkpoint as ckpt
        from unittest import mock

        regions = self

        def apply(function: Callable[..., Any], preserve_rng_state: Any, *args: Any) -> Any:
            # reentrant: no kwargs; the region sees no gradient unless an input requires one
            needs_grad = any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
            with regions._region(), (contextlib.nullcontext() if needs_grad else torch.no_grad()):
                return function(*args)

        def without_reentrant(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Iterator[None]:
            with regions._region():
                yield  # checkpoint() calls function(*args, **kwargs) between the two next()s

        self._stack = contextlib.ExitStack()
        self._stack.enter_context(mock.patch.object(ckpt.CheckpointFunction, "apply", staticmethod(apply)))
        self._stack.enter_context(mock.patch.object(ckpt, "_checkpoint_without_reentrant_generator",
                                                    without_reentrant))
        return self

    def __exit__(self, *exc: Any) -> None:
        assert self._stack is not None
        self._stack.close()
        self._stack = None

    # -- recording ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def _region(self) -> Iterator[None]:
        if self._active is not None:  # nested: part of the outermost region
            yield
            return
        g = _current_graph()
        if g is not None and g is not self._graph:
            self._graph, self.region = g, {}
        last = next(iter(reversed(g.nodes)), None) if g is not None else None
        rid = next(self._ids)
        self._active = rid
        try:
            yield
        finally:
            self._active = None
        if g is None or g is not self._graph:
            return
        node = last.next if last is not None else next(iter(g.nodes), None)
        root = g._root  # sentinel of fx's doubly linked node list
        while node is not None and node is not root:
            if node.op == "call_function":
                self.region.setdefault(node.name, (rid, node.target))
            node = node.next

    # -- applying -----------------------------------------------------------------------------
    def tag(self, gm: fx.GraphModule) -> int:
        """Write `meta["recompute"] = region` on the nodes of the captured graph recorded in a
        region (same name and target). Returns how many nodes were tagged."""
        tagged = 0
        if not self.region:
            return 0
        for n in gm.graph.nodes:
            rec = self.region.get(n.name)
            if rec is not None and n.op == "call_function" and n.target == rec[1]:
                n.meta[RECOMPUTE_KEY] = rec[0]
                tagged += 1
        return tagged


def checkpoint_regions() -> CheckpointRegions:
    """`with checkpoint_regions() as regions: gm = trace(...)`, then `regions.tag(gm)`."""
    return CheckpointRegions()
