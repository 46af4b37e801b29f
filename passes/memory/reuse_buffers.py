"""reuse_buffers: write the step's large short-lived flat buffers (ZeRO-3's gathered parameter
buckets, ZeRO-2/3's flattened gradient buckets) into a few workspaces reused across buckets,
instead of a fresh tensor per bucket.

    before:  a0 = all_gather(shard0)            # new 25 MB tensor
             ... last use of a0 ...
             a2 = all_gather(shard2)            # another new 25 MB tensor
    after:   ws0 = empty(25 MB)                 # allocated once, where first needed
             a0 = all_gather_out(shard0, out=slice(ws0, 0, n0))
             ... last use of a0 ...
             a2 = all_gather_out(shard2, out=slice(ws0, 0, n2))   # a0 is dead: same memory

A fresh large tensor is mapped page by page on first touch; a workspace is faulted in once per
step and then rewritten in place by the next bucket. why: docs/decisions/reuse-buffers.md

Memory stays what it was: workspaces are assigned by liveness (interval colouring in graph
order), so a workspace holds one bucket at a time and is reused only after every alias of its
previous occupant (views, waits, the in-place collective's result) is dead and any collective
still reading or writing it has been waited for. A workspace is a graph value, so the
generated code frees it after its last occupant, as it freed the buckets before.

Only 1-D `cat`s, `constant_pad_nd`s, `all_gather_into_tensor`s and `fxspeed.exchange_gather`s
(runtime/kernels/collectives.py) of at least `min_bytes`
whose value never reaches the graph's outputs are rewritten (a bucket the runtime keeps, as under ZeRO-1, needs its own
memory). Does nothing on one device. Options read from ctx.options: world_size, reuse_min_bytes
(default 0: every such buffer).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from fxspeed.compiler.pass_manager import PassContext, PassResult, graph_pass
from fxspeed.compiler.rewrite import call
from fxspeed.runtime.kernels.collectives import EXCHANGE_OPS, exchange_gather, exchange_gather_out
from fxspeed.runtime.offloaded_activations import offload_activation_op

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

# Allocating op -> its variant writing into `out` (zero padding is written by _pad_into instead).
_OUT_VARIANTS = {aten.cat.default: aten.cat.out,
                 c10d.all_gather_into_tensor.default: c10d.all_gather_into_tensor_out.default,
                 exchange_gather: exchange_gather_out}
_REWRITTEN = {*_OUT_VARIANTS, aten.constant_pad_nd.default}
_WAIT = c10d.wait_tensor.default


@dataclass
class _Workspace:
    dtype: torch.dtype
    device: torch.device
    numel: int = 0
    free_after: int = -1  # graph position of the last use of the current occupant
    occupants: list[fx.Node] = field(default_factory=list)


@graph_pass("reuse_buffers", invalidates=("annotate",))
def reuse_buffers(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    if ctx.options.world_size == 1:
        return PassResult(gm, modified=False)
    min_bytes = ctx.options.reuse_min_bytes
    g = gm.graph
    order = {n: i for i, n in enumerate(g.nodes)}
    spans = []
    for n in g.nodes:
        if _candidate(n, min_bytes):
            end = last_use(n, order)
            if end is not None:
                spans.append((order[n], end, n))
    workspaces: list[_Workspace] = []
    for start, end, n in spans:  # graph order
        ws = _pick(workspaces, n.meta["val"], start)
        ws.numel = max(ws.numel, n.meta["val"].numel())
        ws.free_after = end
        ws.occupants.append(n)
    reused = [ws for ws in workspaces if len(ws.occupants) > 1]
    for ws in reused:
        with g.inserting_before(ws.occupants[0]):
            buf = call(g, aten.empty.memory_format, ([ws.numel],), {"dtype": ws.dtype, "device": ws.device})
        for n in ws.occupants:
            _write_into(g, n, buf, ws.numel)
    if reused:
        g.lint()
    return PassResult(gm, modified=bool(reused))


def _candidate(n: fx.Node, min_bytes: int) -> bool:
    if n.op != "call_function" or n.target not in _REWRITTEN:
        return False
    val = n.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dim() != 1 or val.numel() * val.element_size() < min_bytes:
        return False
    if n.target is aten.constant_pad_nd.default and (len(n.args[1]) != 2 or min(n.args[1]) < 0):
        return False  # only growing a 1-D tensor (a negative pad crops)
    if n.target is aten.cat.default:
        pieces = n.args[0]
        return all(isinstance(p, fx.Node) and p.meta["val"].dtype == val.dtype for p in pieces)
    return True


def last_use(n: fx.Node, order: dict[fx.Node, int]) -> int | None:
    """Graph position after which nothing reads or writes `n`'s memory (views and elements that
    may share it included; an asynchronous collective reads it until its wait); None if it
    escapes (reaches the output, or a user we cannot see through). Also step_in_backward's: the
    last reader of a parameter it updates in place."""
    end = order[n]
    stack, seen = [n], {n}
    while stack:
        a = stack.pop()
        for u in a.users:
            if u.op == "output":
                return None
            end = max(end, order[u])
            if u.op != "call_function" or u.target is offload_activation_op:
                # (an offload copies the value out asynchronously, until a time the graph does not say)
                return None
            if is_collective(u):
                # Runs asynchronously: the memory is in use until the collective is waited for.
                waits = [w for w in u.users if w.target is _WAIT]
                if not waits:
                    return None
                end = max(end, *(order[w] for w in waits))
            if _aliases(u, a) and u not in seen:
                seen.add(u)
                stack.append(u)
    return end


def is_collective(u: fx.Node) -> bool:
    """An asynchronous collective: functional ones and runtime/kernels/collectives' exchanges."""
    return (getattr(u.target, "namespace", None) == "_c10d_functional" and u.target is not _WAIT) or u.target in EXCHANGE_OPS


def _aliases(u: fx.Node, a: fx.Node) -> bool:
    """Whether `u`'s result may share memory with its argument `a` (conservative where the
    schema does not say). Read off the schema's alias sets: an in-place op returns its `self`,
    not the operand it only reads, so `acc.add_(bucket[:n])` ends the bucket's life there. Taking
    any aliasing result as aliasing every argument had kept ZeRO-2's gloo bucket workspace alive up
    to its in-backward step, after the next bucket's flatten, which then took fresh memory: one
    bucket (28 MB for an 18M Llama, fp32 ZeRO-2 on 2 ranks) over the plan at the step's peak."""
    if u.target is _WAIT or u.target is operator.getitem:
        return True
    schema = getattr(u.target, "_schema", None)
    if schema is None:
        return True  # unknown callable: assume it may return a view
    returned = set()
    for r in schema.returns:
        if r.alias_info is not None:
            returned |= set(r.alias_info.before_set) | set(r.alias_info.after_set)
    if not returned:
        return False
    found = False
    for i, arg in enumerate(schema.arguments):
        given = u.args[i] if i < len(u.args) and not arg.kwarg_only else u.kwargs.get(arg.name)
        if not _passes(given, a):
            continue
        found = True
        info = arg.alias_info
        if info is None:
            continue  # read only: the result is not `a`'s memory
        sets = set(info.before_set) | set(info.after_set)
        if "*" in sets or "*" in returned or sets & returned:
            return True
    return not found  # `a` reached the op some other way than the schema's arguments: assume a view


def _passes(given: object, a: fx.Node) -> bool:
    """Whether the argument value `given` is `a` or a list/tuple holding it."""
    if given is a:
        return True
    return isinstance(given, (list, tuple)) and any(g is a for g in given)


def _pick(workspaces: list[_Workspace], val: torch.Tensor, start: int) -> _Workspace:
    """A free workspace of the same dtype: the smallest that fits, else the largest (grown).
    Among equals the one freed last: reusing few workspaces lets the others die early.
    why: docs/decisions/reuse-buffers.md"""
    free = [ws for ws in workspaces if ws.dtype == val.dtype and ws.device == val.device and ws.free_after < start]
    fits = [ws for ws in free if ws.numel >= val.numel()]
    if fits:
        return min(fits, key=lambda ws: (ws.numel, -ws.free_after))
    if free:
        return max(free, key=lambda ws: (ws.numel, ws.free_after))
    workspaces.append(_Workspace(val.dtype, val.device))
    return workspaces[-1]


def _write_into(g: fx.Graph, n: fx.Node, buf: fx.Node, size: int) -> None:
    """Replace the allocating `n` by its out= variant writing the first numel elements of `buf`."""
    numel = n.meta["val"].numel()
    with g.inserting_before(n):
        out = buf if numel == size else call(g, aten.slice.Tensor, (buf, 0, 0, numel))
        if n.target is aten.constant_pad_nd.default:
            new = _pad_into(g, n, out, numel)
        else:
            new = call(g, _OUT_VARIANTS[n.target], n.args, {**n.kwargs, "out": out})
    new.meta.update({k: v for k, v in n.meta.items() if k != "val"})
    n.replace_all_uses_with(new)
    g.erase_node(n)


def _pad_into(g: fx.Graph, n: fx.Node, out: fx.Node, numel: int) -> fx.Node:
    """constant_pad_nd(src, [left, right], value) written into `out` in place.

    ATen's constant_pad_nd.out computes into a new tensor and copies it (page faults: see
    docs/decisions/reuse-buffers.md), so fill the two margins and copy the middle instead:

        fill_(out[:left], value); fill_(out[numel-right:], value); copy_(out[left:numel-right], src)

    The result is re-derived from the copy (as_strided over the whole workspace view, which
    starts at offset 0) so the reader depends on the writes through the data flow."""
    src, (left, right) = n.args[0], n.args[1]
    value = n.args[2] if len(n.args) > 2 else n.kwargs.get("value", 0.0)
    if left:
        call(g, aten.fill_.Scalar, (call(g, aten.slice.Tensor, (out, 0, 0, left)), value))
    if right:
        call(g, aten.fill_.Scalar, (call(g, aten.slice.Tensor, (out, 0, numel - right, numel)), value))
    mid = call(g, aten.copy_.default, (call(g, aten.slice.Tensor, (out, 0, left, numel - right)), src))
    return call(g, aten.as_strided.default, (mid, [numel], [1], 0))
