"""Liveness analysis: bytes alive at every node of a step, by category.

Walks the graph in execution order; a node's output is allocated when it runs and freed after
its last reader (views and tuple elements keep their base alive). Graph inputs (parameters,
buffers, the batch) are alive throughout; graph outputs (loss, gradients, buffer updates)
stay alive to the end. This mirrors what FX codegen does at run time: it drops each value
right after its last use.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from fxspeed.ir import ACTIVATIONS, GRADIENTS, META_KEY, TEMPORARIES, NodeInfo, tensor_bytes

_PROMOTE = {ACTIVATIONS: 1, GRADIENTS: 2}


@dataclass
class Timeline:
    """Live bytes after each node runs (`totals[i]`), and the breakdown at the peak."""

    names: list[str] = field(default_factory=list)
    roles: list[str] = field(default_factory=list)
    totals: list[int] = field(default_factory=list)
    gradients: list[int] = field(default_factory=list)  # live gradient bytes after each node
    peak_index: int = 0
    peak: dict[str, int] = field(default_factory=dict)

    @property
    def peak_bytes(self) -> int:
        return sum(self.peak.values())


def memory_timeline(gm: fx.GraphModule, grad_scale: float = 1.0) -> Timeline:
    """Live bytes after every node. The peak is where `total - (1 - grad_scale) * gradients` is
    largest: a rank that keeps only a 1/N shard of each gradient (ZeRO-2/3) peaks where its own
    bytes do, which need not be where the whole graph's do."""
    nodes = list(gm.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    end = len(nodes)

    def base(n: fx.Node) -> fx.Node:
        # A view shares its input's storage; a tuple element is its own allocation.
        while True:
            inf: NodeInfo | None = n.meta.get(META_KEY)
            if n.target is operator.getitem or inf is None or not inf.is_view or not n.all_input_nodes:
                return n
            n = n.all_input_nodes[0]

    alloc: dict[fx.Node, tuple[int, str]] = {}
    last_use: dict[fx.Node, int] = {}
    # A storage takes the strongest category of any value that aliases it: the forward saves a
    # view of a tensor for backward (the tensor is then an activation), a gradient is often a
    # view (`t`, `view`) of the matmul that computed it (the matmul's output is the gradient).
    promoted: dict[fx.Node, str] = {}
    for n in nodes:
        inf = n.meta.get(META_KEY)
        if inf is not None and inf.category in _PROMOTE and n.op == "call_function":
            b = base(n)
            if _PROMOTE[inf.category] > _PROMOTE.get(promoted.get(b, ""), 0):
                promoted[b] = inf.category
    for n in nodes:
        if n.op == "output":
            for a in n.all_input_nodes:
                last_use[base(a)] = end
            continue
        inf: NodeInfo | None = n.meta.get(META_KEY)
        cat = inf.category if inf else TEMPORARIES
        val = n.meta.get("val")
        if n.op == "placeholder":
            alloc[n] = (tensor_bytes(val), cat)
            last_use[n] = end
        elif isinstance(val, torch.Tensor) and (n.target is operator.getitem or not (inf and inf.is_view)):
            if cat == TEMPORARIES or _PROMOTE.get(promoted.get(n, ""), 0) > _PROMOTE.get(cat, 0):
                cat = promoted.get(n, cat)
            alloc[n] = (tensor_bytes(val), cat)
            last_use.setdefault(n, index[n])
        for a in n.all_input_nodes:
            b = base(a)
            last_use[b] = max(last_use.get(b, 0), index[n])

    frees: dict[int, list[fx.Node]] = {}
    for n, i in last_use.items():
        frees.setdefault(i, []).append(n)

    tl = Timeline()
    live: dict[str, int] = {}
    best = -1
    for i, n in enumerate(nodes):
        if n in alloc:
            size, cat = alloc[n]
            live[cat] = live.get(cat, 0) + size
        total = sum(live.values())
        tl.names.append(n.name)
        inf = n.meta.get(META_KEY)
        tl.roles.append(inf.role if inf else "")
        tl.totals.append(total)
        tl.gradients.append(live.get(GRADIENTS, 0))
        weighted = total - (1.0 - grad_scale) * live.get(GRADIENTS, 0)
        if weighted > best:
            best, tl.peak_index, tl.peak = weighted, i, dict(live)
        for dead in frees.get(i, ()):
            if dead in alloc:
                size, cat = alloc[dead]
                live[cat] -= size
    return tl
