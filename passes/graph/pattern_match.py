"""Small structural predicates the graph pattern matchers share (rms_norm_pattern, rotary_pattern,
activation_pattern, residual_norm_pattern): what a node is, the fake value it carries, and how a
replacement node takes over the metadata of the node it stands for.

Every predicate takes `Any` (an argument of a node may be a number, a list or None) and answers
False / None for anything that is not the node it asks about, so a matcher reads as a chain of
checks without isinstance noise.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.fx as fx

aten = torch.ops.aten


def is_call(n: Any, target: Any, nargs: int) -> bool:
    """n calls `target` with exactly `nargs` positional arguments and no keyword arguments."""
    return (isinstance(n, fx.Node) and n.op == "call_function" and n.target is target and not n.kwargs
            and len(n.args) == nargs)


def is_number(v: Any, want: float) -> bool:
    """v is the Python number `want` (a bool is not a number here)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and float(v) == want


def tensor_value(n: Any) -> Optional[torch.Tensor]:
    """The (fake) tensor a node carries in meta["val"], or None."""
    v = n.meta.get("val") if isinstance(n, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def is_like(n: Any, shape: tuple, dtype: torch.dtype) -> bool:
    """n carries a tensor of this shape and dtype."""
    v = tensor_value(n)
    return v is not None and tuple(v.shape) == tuple(shape) and v.dtype == dtype


def other_operand(n: Any, target: Any, a: fx.Node) -> Optional[fx.Node]:
    """For n = target(a, b) or target(b, a) (a binary op, e.g. aten.add.Tensor) with a tensor b: b."""
    if not is_call(n, target, 2):
        return None
    l, r = n.args
    b = r if l is a else l if r is a else None
    return b if isinstance(b, fx.Node) else None


def mul_operand(n: Any, a: fx.Node) -> Optional[fx.Node]:
    """For n = mul.Tensor(a, b) or mul.Tensor(b, a) with a tensor b: b."""
    return other_operand(n, aten.mul.Tensor, a)


def rewrite_each(graph: fx.Graph, anchor: Any, match: Callable[[fx.Node], Any],
                 rewrite: Callable[[fx.Graph, Any, dict[str, str]], bool], module_of: dict[str, str]) -> int:
    """Matches a region at every node calling `anchor` (listed before any rewrite; nodes an
    earlier rewrite erased are skipped) and rewrites each match; the number rewritten."""
    count = 0
    for n in [m for m in graph.nodes if m.op == "call_function" and m.target is anchor]:
        if getattr(n, "_erased", False):
            continue
        mt = match(n)
        if mt is not None and rewrite(graph, mt, module_of):
            count += 1
    return count


def users_of(n: fx.Node) -> set[fx.Node]:
    return set(n.users)


def same_meta(new: fx.Node, old: fx.Node) -> bool:
    """A replacement carries a tensor of the replaced node's shape and dtype."""
    a, b = tensor_value(new), tensor_value(old)
    return a is not None and b is not None and tuple(a.shape) == tuple(b.shape) and a.dtype == b.dtype


def inherit_meta(new: fx.Node, old: fx.Node, module_of: dict[str, str]) -> None:
    """`new` stands for `old`: it takes the metadata it lacks (stack trace, module, checkpoint
    tags) and old's module (annotate finds forward nodes' modules by name)."""
    for k, v in old.meta.items():
        new.meta.setdefault(k, v)
    if old.name in module_of:
        module_of[new.name] = module_of[old.name]
