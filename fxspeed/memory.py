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

from .ir import META_KEY, TEMPORARIES, NodeInfo, tensor_bytes


@dataclass
class Timeline:
    """Live bytes after each node runs (`totals[i]`), and the breakdown at the peak."""

    names: list[str] = field(default_factory=list)
    roles: list[str] = field(default_factory=list)
    totals: list[int] = field(default_factory=list)
    peak_index: int = 0
    peak: dict[str, int] = field(default_factory=dict)

    @property
    def peak_bytes(self) -> int:
        return sum(self.peak.values())


def memory_timeline(gm: fx.GraphModule) -> Timeline:
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
        if total > best:
            best, tl.peak_index, tl.peak = total, i, dict(live)
        for dead in frees.get(i, ()):
            if dead in alloc:
                size, cat = alloc[dead]
                live[cat] -= size
    return tl
