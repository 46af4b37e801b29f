"""Residual add + norm: the add that makes a pre-norm transformer's residual stream, fused into the
norm that reads it, and the add that accumulates that stream's gradient fused into the norm's
backward (runtime/kernels/residual_norms.py). Runs on fuse_kernels' output, so every norm it
looks at is already fxspeed.layer_norm_fwd / rms_norm_fwd / their _bwd (ATen's or written out).

    before (forward)                                   after
      h = aten.add.Tensor(x, r)                          f = fxspeed.add_layer_norm_fwd(x, r, [C], w, b, eps)
      n = fxspeed.layer_norm_fwd(h, [C], w, b, eps)      h = f[0]; y = f[1]; mean = f[2]; rstd = f[3]
      y = n[0]; mean = n[1]; rstd = n[2]                 (h keeps its other readers: the next residual
                                                          add, the norm's backward)
    before (backward)
      nb = fxspeed.layer_norm_bwd(dy, h, [C], mean, rstd, w, b)
      dx = nb[0]; dw = nb[1]; db = nb[2]                 bb = fxspeed.layer_norm_bwd_add(dy, h, [C], mean, rstd,
      gh = aten.add.Tensor(g, dx)      (or (dx, g))                                     w, b, g)
                                                         gh = bb[0]; dw = bb[1]; db = bb[2]

and the same for RMSNorm (fxspeed.add_rms_norm_fwd -> (h, y, rstd); fxspeed.rms_norm_bwd_add).
In backward, g is the gradient h gets from its other readers (the next residual add passes its
own gradient through), and dx is read by nothing but the add: autograd accumulating h's gradient.

Exact forms only; anything else is left as it is:
  forward:  the norm's input is aten.add.Tensor of two tensors, no alpha, both of the norm
            input's shape (not a broadcast, not a scalar), floating; of its dtype, or one of
            them a lower-precision float it promotes from (bf16 programs add the bf16 sublayer
            output to the fp32 residual stream: fp32 = fp32 + bf16, exact upcast); the add
            and the norm in the same phase (forward, or both in backward as a recomputed copy),
            and every other reader of h after the norm. Not fused: `x + r` with r broadcast,
            `add(x, r, alpha=2)`, `norm((x + r) * s)` (the norm reads a mul), a norm copied into
            backward reading a forward add. `x + s * r` is fused (an exact add of x and the mul,
            which stays).
  backward: the norm backward's input gradient is read by exactly one aten.add.Tensor whose
            other operand is a different tensor of the same shape and dtype, in the same phase.
Forward and backward are matched independently: the fused backward reads h (a value the norm's
backward reads either way, however it was produced) and the fused forward produces every value
the unfused nodes did, so each rewrite is correct alone (a norm whose input is not an add still
gets its backward fused when its input gradient is accumulated; the last norm, whose input
gradient has other readers, gets its forward fused only). Several norms reading one add: the
first in graph order fuses it; the others then read h = f[0] and stay as they are.

Exactness: the fused ops compute the unfused nodes' values (their torch fallback is literally
those ops; the kernels add in fp32 and round h as ATen's add does, and round the input gradient
+ grad_h once instead of twice), so no numeric check is made at compile time; `same_meta`
guards each rewrite (shapes and dtypes of every replaced value), else the graph is left as it was.

Where it runs: after recompute_pointwise, which recomputes each fxspeed norm forward in backward
from h instead of keeping its output. A fused add + norm reads x and r, and r (the sublayer's
output) is not kept for backward, so recompute_pointwise cannot recompute a fused forward: run
before it, the plan keeps every fused norm's output until backward. Measured (fxspeed GPT, 4
layers, C=128, 256 rows, fp32; fuse_kernels alone -> this pass at the end of fuse_kernels ->
after recompute_pointwise): planned activations 5.26 -> 6.19 -> 5.26 MB, peak 16.85 -> 17.78 ->
16.85 MB, bytes read + written by all nodes 85.17 -> 79.90 -> 82.03 MB (the 3.15 MB are
exactly 8 fused pairs x (1 row-width tensor in forward + 2 in backward)), kernel launches 408 ->
376 -> 392. HF Llama (4 layers, bf16): activations 4.36 -> 5.28 -> 4.36 MB. Run on a graph that
recompute_pointwise has not seen (tensor parallelism, inference, recompute_pointwise disabled),
the forward fusion costs nothing: the norm's outputs were kept (or not needed) anyway.
"""

from __future__ import annotations

import functools
import operator
from typing import Any, Callable, Optional

import torch
import torch.fx as fx

from fxspeed.compiler.rewrite import call
from fxspeed.ir import META_KEY

from .pattern_match import inherit_meta, is_call, same_meta, tensor_value


aten = torch.ops.aten
_ops = torch.ops.fxspeed


# norm op -> (fused op, the norm's arguments as the fused op takes them: after x and r / before grad_h)
_Table = dict[Any, tuple[Any, Callable[[dict[str, Any]], tuple]]]


def _fused_targets() -> tuple[_Table, _Table]:
    """(forward table, backward table)."""
    import fxspeed.runtime.kernels.residual_norms  # noqa: F401  registers the fused ops (triton is not imported)

    forward = {
        _ops.layer_norm_fwd.default: (_ops.add_layer_norm_fwd.default,
                                      lambda a: (a["normalized_shape"], a["weight"], a["bias"], a["eps"])),
        _ops.rms_norm_fwd.default: (_ops.add_rms_norm_fwd.default,
                                    lambda a: (a["normalized_shape"], a["weight"], a["eps"])),
    }
    backward = {
        _ops.layer_norm_bwd.default: (_ops.layer_norm_bwd_add.default,
                                      lambda a: (a["grad_out"], a["x"], a["normalized_shape"], a["mean"], a["rstd"],
                                                 a["weight"], a["bias"])),
        _ops.rms_norm_bwd.default: (_ops.rms_norm_bwd_add.default,
                                    lambda a: (a["grad_out"], a["x"], a["normalized_shape"], a["rstd"], a["weight"])),
    }
    return forward, backward


# --- small predicates ---------------------------------------------------------------------------

def _arguments(n: fx.Node) -> Optional[dict[str, Any]]:
    """The node's arguments by schema name (torch's normalization: positional or keyword)."""
    pair = n.normalized_arguments(None, normalize_to_only_use_kwargs=True)
    return dict(pair.kwargs) if pair is not None else None


# meta keys of the copies recompute_checkpointed / recompute_pointwise put into backward: a copy
# keeps its original's NodeInfo (role "forward") until annotate runs again
_COPY_TAGS = ("recomputed_from", "recomputed_pointwise")


def _phase(n: fx.Node) -> tuple[Optional[str], bool]:
    """Where n runs: annotate's role (None unannotated) and whether it is a recomputed copy. An add
    and a norm of different phases are not fused: the fused op would compute h, or the norm's
    outputs, where the other ran (in backward, keeping x and r alive until then, or in forward,
    keeping the outputs a recomputation was there to drop)."""
    return getattr(n.meta.get(META_KEY), "role", None), any(t in n.meta for t in _COPY_TAGS)


def _alike(*nodes: Any, promoted: bool = False) -> bool:
    """Floating tensors of one shape (no broadcast) and one dtype; with `promoted`, the first is
    what ATen's add of the others gives (fp32 from fp32 + bf16: an exact upcast, then the add)."""
    vals = [tensor_value(n) for n in nodes]
    if any(v is None or not v.is_floating_point() or tuple(v.shape) != tuple(vals[0].shape) for v in vals):
        return False
    if promoted:
        return vals[0].dtype == functools.reduce(torch.promote_types, [v.dtype for v in vals[1:]])
    return all(v.dtype == vals[0].dtype for v in vals)


def _items(n: fx.Node) -> Optional[dict[int, fx.Node]]:
    """index -> getitem node for a tuple-valued node read only through getitems (one per index)."""
    out: dict[int, fx.Node] = {}
    for u in n.users:
        if not (u.op == "call_function" and u.target is operator.getitem and isinstance(u.args[1], int)) \
                or u.args[1] in out:
            return None
        out[u.args[1]] = u
    return out


# --- the rewrites -------------------------------------------------------------------------------

def _build(graph: fx.Graph, before: fx.Node, target: Any, args: tuple, replaced: dict[int, fx.Node],
           module_of: dict[str, str], like: fx.Node) -> Optional[fx.Node]:
    """Insert `f = target(*args)` and a getitem for each index of `replaced` before `before`; point
    every reader of replaced[i] at f[i] and erase replaced[i]. None (graph unchanged) when some
    f[i] differs from replaced[i] in shape or dtype."""
    with graph.inserting_before(before):
        f = call(graph, target, args)
        new = {i: call(graph, operator.getitem, (f, i)) for i in sorted(replaced)}
    if not all(same_meta(new[i], old) for i, old in replaced.items()):
        for m in [*new.values(), f]:
            graph.erase_node(m)
        return None
    inherit_meta(f, like, module_of)
    for i, old in replaced.items():
        inherit_meta(new[i], old, module_of)
        old.replace_all_uses_with(new[i])
    for old in replaced.values():
        graph.erase_node(old)
    return f


def _fuse_forward(graph: fx.Graph, n: fx.Node, fused: Any, rest: tuple, module_of: dict[str, str]) -> bool:
    """n = norm(h, ...) with h = add(x, r) -> add_norm(x, r, ...): h and the norm's outputs from it."""
    h = rest[0]
    if not is_call(h, aten.add.Tensor, 2) or not all(isinstance(a, fx.Node) for a in h.args):
        return False
    x, r = h.args
    items = _items(n)
    if items is None or not _alike(h, x, r, promoted=True) or _phase(h) != _phase(n):
        return False
    # f goes where n is: h's other readers (the next residual add, the backward) must come later
    if any(u < n for u in h.users):  # fx nodes compare by graph order
        return False
    replaced = {0: h, **{i + 1: g for i, g in items.items()}}
    f = _build(graph, n, fused, (x, r, *rest[1:]), replaced, module_of, like=n)
    if f is None:
        return False
    graph.erase_node(n)
    return True


def _fuse_backward(graph: fx.Graph, nb: fx.Node, fused: Any, args: tuple, module_of: dict[str, str]) -> bool:
    """nb = norm_bwd(...), s = add(g, nb[0]) -> norm_bwd_add(..., g): s and nb's other outputs from it."""
    items = _items(nb)
    if items is None or 0 not in items or len(items[0].users) != 1:
        return False
    dx = items[0]
    s = next(iter(dx.users))
    if not is_call(s, aten.add.Tensor, 2) or s.args.count(dx) != 1:
        return False
    g = s.args[1] if s.args[0] is dx else s.args[0]
    if not isinstance(g, fx.Node) or not _alike(s, dx, g) or _phase(s) != _phase(nb):
        return False
    # the fused node needs g: it goes after both nb and g, before any reader of nb's other outputs
    after = max(nb, g)
    if any(u <= after for i, m in items.items() if i != 0 for u in m.users):
        return False
    replaced = {0: s, **{i: m for i, m in items.items() if i != 0}}
    f = _build(graph, after.next, fused, (*args, g), replaced, module_of, like=nb)
    if f is None:
        return False
    graph.erase_node(dx)
    graph.erase_node(nb)
    return True


def fuse_residual_norms(graph: fx.Graph, module_of: dict[str, str]) -> int:
    """Fuse every residual add into the fxspeed norm reading it, and every norm backward into the
    add accumulating its input gradient (the docstring's forms); the number of fused ops made
    (forward and backward counted apart). `module_of` (forward node name -> module, what
    annotate reads) gets the new nodes' entries."""
    forward, backward = _fused_targets()
    count = 0
    for n in list(graph.nodes):
        if getattr(n, "_erased", False) or n.op != "call_function" or n.target not in (*forward, *backward):
            continue
        a = _arguments(n)
        if a is None:
            continue
        if n.target in forward:
            fused, rest = forward[n.target]
            done = _fuse_forward(graph, n, fused, (a["x"], *rest(a)), module_of)
        else:
            fused, rest = backward[n.target]
            done = _fuse_backward(graph, n, fused, rest(a), module_of)
        count += done
    return count


__all__ = ["fuse_residual_norms"]
