"""Liveness analysis: bytes alive at every node of a step, by category.

Walks the graph in execution order; a node's output is allocated when it runs and freed after
its last reader (views and tuple elements keep their base alive); the scratch an op declares
(`op_workspace`: a fused kernel's accumulators) is alive while that node runs. Graph inputs (parameters,
buffers, the batch) are alive throughout; graph outputs (loss, gradients, buffer updates)
stay alive to the end. This mirrors what FX codegen does at run time: it drops each value
right after its last use.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from fxspeed.ir import (ACTIVATIONS, BACKWARD, FORWARD, GRADIENTS, META_KEY, STEP, TEMPORARIES, NodeInfo, op_workspace,
                        tensor_bytes)

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
    # For extrapolating the timeline of a deeper stack (planner/extrapolate.py): each node's
    # live bytes by category, what it computes (op and target: equal for the same op of two
    # blocks), and the grad_scale the peak was chosen with.
    live: list[dict[str, int]] = field(default_factory=list, repr=False)
    keys: list[str] = field(default_factory=list, repr=False)
    grad_scale: float = 1.0
    # The peak's breakdown within forward (and the program's inputs) and within backward (and the
    # optimizer steps in it), chosen as `peak` is: the planner adds gradient buckets in flight to
    # backward's only (phase_of)
    phase_peaks: dict[str, dict[str, int]] = field(default_factory=dict)
    # Gradient bytes made so far after each node (every allocation of the gradients category):
    # a replica's gradient buckets in flight hold at most these (backward_front)
    produced: list[int] = field(default_factory=list, repr=False)

    @property
    def peak_bytes(self) -> int:
        return sum(self.peak.values())

    def backward_front(self) -> list[tuple[float, dict]]:
        """`backward_front` over this timeline's nodes."""
        return backward_front((phase_of(role), made, live, total - (1.0 - self.grad_scale) * grads)
                              for role, made, live, total, grads
                              in zip(self.roles, self.produced, self.live, self.totals, self.gradients))


def phase_of(role: str) -> str:
    """BACKWARD for a node of backward or an optimizer step inside it, else FORWARD (forward's
    nodes and the program's inputs): gradient buckets are in flight only in the first."""
    return BACKWARD if role in (BACKWARD, STEP) else FORWARD


def backward_front(points: Iterable[tuple[str, float, dict, float]]) -> list[tuple[float, dict]]:
    """The nodes of backward that can be a replica's peak once its gradient buckets in flight are
    added, as (gradient bytes made so far, live bytes by category), from `points` (phase, bytes
    made so far, live bytes, weighted total) in execution order.

    The buckets in flight hold at most what backward has made so far: little at backward's
    start, where activations peak, up to two buckets further on. So for each amount made, the
    node with the most weighted bytes; and of those only the ones above every later one (a
    later node has made at least as much, so holds at least as many buckets).

    >>> backward_front([("backward", 0, {"activations": 9}, 9), ("backward", 4, {"activations": 6}, 6),
    ...                 ("backward", 4, {"activations": 7}, 7), ("backward", 8, {"activations": 2}, 2)])
    [(0, {'activations': 9}), (4, {'activations': 7}), (8, {'activations': 2})]
    """
    best: dict[float, tuple[float, dict]] = {}
    for phase, made, live, weighted in points:
        if phase == BACKWARD and (made not in best or weighted > best[made][0]):
            best[made] = (weighted, live)
    front: list[tuple[float, dict]] = []
    top = float("-inf")
    for made in sorted(best, reverse=True):
        weighted, live = best[made]
        if weighted > top:
            top = weighted
            front.append((made, live))
    return front[::-1]


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

    tl = Timeline(grad_scale=grad_scale)
    live: dict[str, int] = {}
    made = 0
    best = -1
    phase_best: dict[str, float] = {}
    for i, n in enumerate(nodes):
        if n in alloc:
            size, cat = alloc[n]
            live[cat] = live.get(cat, 0) + size
            if cat == GRADIENTS:
                made += size
        inf = n.meta.get(META_KEY)
        now = dict(live)  # what is alive while n runs: its own scratch too, freed when it returns
        if inf is not None and inf.workspace:
            now[TEMPORARIES] = now.get(TEMPORARIES, 0) + inf.workspace
        total = sum(now.values())
        tl.names.append(n.name)
        tl.roles.append(inf.role if inf else "")
        tl.totals.append(total)
        tl.gradients.append(live.get(GRADIENTS, 0))
        tl.produced.append(made)
        tl.live.append(now)
        tl.keys.append(f"{n.op}:{n.target}" if n.op == "call_function" else n.op)
        weighted = total - (1.0 - grad_scale) * live.get(GRADIENTS, 0)
        if weighted > best:
            best, tl.peak_index, tl.peak = weighted, i, now
        phase = phase_of(tl.roles[-1])
        if weighted > phase_best.get(phase, -1):
            phase_best[phase], tl.phase_peaks[phase] = weighted, now
        for dead in frees.get(i, ()):
            if dead in alloc:
                size, cat = alloc[dead]
                live[cat] -= size
    return tl


# --------------------------------------------------------------------------------------------
# One graph program, run with its inputs owned by someone else (pipeline stage programs)
# --------------------------------------------------------------------------------------------

@dataclass
class ProgramLiveness:
    """What a graph program allocates while it runs, apart from its inputs.

    `live[i]`: bytes of values the program itself allocated that are alive while node i runs
    (its output allocated, its dead operands not yet freed). Inputs are counted by the caller,
    who knows who else holds them; `last_use[j]` says after which node input j is dead inside
    the program (len(nodes) when an output is, or is a view of, that input). `outputs` are
    (bytes, index of the input the output aliases or None, storage id): outputs with one
    storage id share memory and count once.
    """

    inputs: list[int] = field(default_factory=list)
    last_use: list[int] = field(default_factory=list)
    live: list[int] = field(default_factory=list)
    outputs: list[tuple[int, int | None, int]] = field(default_factory=list)

    def peak(self, freed: set[int] | frozenset[int] = frozenset()) -> int:
        """Largest bytes held above the inputs at any node, when the inputs in `freed` are
        released at their last use (a program called with a list it empties, as the pipeline
        runtime calls F, B and W) and the others stay alive throughout."""
        drop = [0] * (len(self.live) + 1)
        for j in freed:
            if self.last_use[j] < len(self.live):
                drop[self.last_use[j] + 1] += self.inputs[j]
        best, gone = 0, 0
        for i, b in enumerate(self.live):
            gone += drop[i]
            best = max(best, b - gone)
        return best


def _aliased_input(n: fx.Node) -> fx.Node | None:
    """The operand whose storage `n`'s result is (views, in-place and out= ops), or None."""
    target = n.target
    schema = getattr(target, "_schema", None)
    if schema is not None:
        ret = schema.returns[0].alias_info if schema.returns else None
        if ret is None:
            return None
        for k, arg in enumerate(schema.arguments):
            if arg.alias_info is None or not set(arg.alias_info.before_set) & set(ret.before_set):
                continue
            v = n.kwargs.get(arg.name) if arg.kwarg_only or k >= len(n.args) else n.args[k]
            return v if isinstance(v, fx.Node) else None
        return None
    inf: NodeInfo | None = n.meta.get(META_KEY)
    if target is not operator.getitem and ((inf is not None and inf.is_view)
                                           or getattr(target, "__name__", "").endswith("_")):
        return n.all_input_nodes[0] if n.all_input_nodes else None  # a view, or an in-place helper (name_)
    return None


def program_liveness(gm: fx.GraphModule) -> ProgramLiveness:
    """Liveness of one program's own allocations (see ProgramLiveness); FX frees each value
    after its last reader, a view keeps its base alive, a tuple element is its own storage."""
    nodes = list(gm.graph.nodes)
    end = len(nodes)
    index = {n: i for i, n in enumerate(nodes)}
    placeholders = [n for n in nodes if n.op == "placeholder"]
    base_of: dict[fx.Node, fx.Node] = {}

    def base(n: fx.Node) -> fx.Node:
        if n not in base_of:
            a = _aliased_input(n) if n.op == "call_function" else None
            base_of[n] = n if a is None else base(a)
        return base_of[n]

    alloc: dict[fx.Node, int] = {}
    last: dict[fx.Node, int] = {}
    for n in nodes:
        if n.op == "output":
            for a in n.all_input_nodes:
                last[base(a)] = end
            continue
        if n.op == "call_function" and base(n) is n and isinstance(n.meta.get("val"), torch.Tensor):
            alloc[n] = tensor_bytes(n.meta["val"])
            last.setdefault(n, index[n])
        for a in n.all_input_nodes:
            b = base(a)
            last[b] = max(last.get(b, 0), index[n])
    frees: dict[int, int] = {}
    for n, size in alloc.items():
        frees[last[n]] = frees.get(last[n], 0) + size
    live, total = [], 0
    for i, n in enumerate(nodes):
        total += alloc.get(n, 0)
        live.append(total + op_workspace(n))
        total -= frees.get(i, 0)
    out_node = nodes[-1]
    results = out_node.args[0] if out_node.op == "output" else ()
    results = results if isinstance(results, (tuple, list)) else (results,)
    ph_index = {ph: j for j, ph in enumerate(placeholders)}
    outputs = []
    for r in results:
        if not isinstance(r, fx.Node):
            outputs.append((0, None, -1))
            continue
        b = base(r)
        if b in ph_index:
            outputs.append((tensor_bytes(b.meta.get("val")), ph_index[b], index[b]))
        else:
            outputs.append((alloc.get(b, 0), None, index[b]))
    return ProgramLiveness(inputs=[tensor_bytes(ph.meta.get("val")) for ph in placeholders],
                           last_use=[last.get(ph, -1) for ph in placeholders], live=live, outputs=outputs)
