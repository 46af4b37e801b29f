"""`p.copy_(t)` into a Parameter of the user's module whose values the engine holds elsewhere.

Under ZeRO-3 (and master weights, and on another pipeline stage's ranks) the module holds 0-size
placeholders; under tensor parallelism each rank's slice. A user loading a whole weight by hand
(`with torch.no_grad(): p.copy_(whole)`) got torch's bare "size of tensor a (0) must match the
size of tensor b (8)", which says nothing of why the Parameter is not whole. `p.data = whole`
is taken at the next step (TensorParallelParameters.adopt_reassigned); copy_ cannot wait: it
writes now. So the engine gives those Parameters a class of their own (an nn.Parameter in every
other respect: traced, pickled and optimized as one) whose copy_ asks the engine first when the
source does not fit: the engine cuts a whole weight to this rank's slice, or raises an error
that names the parameter and what to use instead.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Iterable

import torch
import torch.nn as nn

_FIX = "_fxspeed_copy_fix"  # the instance attribute holding what to do (deepcopy and pickle drop it)


class HeldElsewhere(nn.Parameter):
    """A Parameter whose values the engine holds elsewhere (see the module docstring)."""

    def copy_(self, src: Any, non_blocking: bool = False) -> torch.Tensor:  # type: ignore[override]
        fix = self.__dict__.get(_FIX)
        if fix is not None and isinstance(src, torch.Tensor) and not _fits(src, self):
            src = fix(self, src)
        return super().copy_(src, non_blocking)

    def __repr__(self) -> str:  # as an nn.Parameter's (not "Parameter(HeldElsewhere(...))")
        plain = torch.Tensor._make_subclass(torch.Tensor, self.detach(), self.requires_grad)
        return "Parameter containing:\n" + plain.__repr__()

    def __reduce_ex__(self, proto: int) -> Any:  # pickled as a plain nn.Parameter
        return nn.Parameter(self.data, self.requires_grad).__reduce_ex__(proto)


def _fits(src: torch.Tensor, dst: torch.Tensor) -> bool:
    """copy_ takes `src` as torch would: its shape broadcasts to `dst`'s."""
    try:
        return torch.broadcast_shapes(tuple(src.shape), tuple(dst.shape)) == tuple(dst.shape)
    except RuntimeError:
        return False


class _Fix:
    """The engine's method, held weakly (a Parameter outlives a dropped engine with its model):
    once the engine is gone, copy_ is torch's again."""

    def __init__(self, method: Callable[..., torch.Tensor], kwargs: dict[str, Any]) -> None:
        self.method, self.kwargs = weakref.WeakMethod(method), kwargs

    def __call__(self, p: nn.Parameter, src: torch.Tensor) -> torch.Tensor:
        method = self.method()
        return src if method is None else method(p, src, **self.kwargs)


def guard_copies(params: Iterable[nn.Parameter], method: Callable[..., torch.Tensor], **kwargs: Any) -> None:
    """copy_ of a source that does not fit into one of `params` calls `method(p, src, **kwargs)`
    (a bound method, held weakly), which returns what to copy instead or raises. A Parameter of
    the user's own subclass keeps torch's error. (No weak reference to the Parameters: deferred
    init swaps meta Parameters for real ones in place, which torch refuses for one weakly held.)"""
    fix = _Fix(method, kwargs)
    for p in params:
        if type(p) is nn.Parameter:
            p.__class__ = HeldElsewhere
        if isinstance(p, HeldElsewhere):
            p.__dict__[_FIX] = fix


def same_kind(t: nn.Parameter, data: torch.Tensor) -> nn.Parameter:
    """A Parameter of `data` to swap into `t` (torch.utils.swap_tensors swaps the classes and
    attributes too): a guarded one stays guarded."""
    new = (HeldElsewhere if isinstance(t, HeldElsewhere) else nn.Parameter)(data, t.requires_grad)
    if isinstance(t, HeldElsewhere) and _FIX in t.__dict__:
        new.__dict__[_FIX] = t.__dict__[_FIX]
    return new
