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

# id(Parameter) -> (a weak reference to it, what to do with a source that does not fit)
_FIX: dict[int, tuple[Any, Callable[[nn.Parameter, torch.Tensor], torch.Tensor]]] = {}


class HeldElsewhere(nn.Parameter):
    """A Parameter whose values the engine holds elsewhere (see the module docstring)."""

    def copy_(self, src: Any, non_blocking: bool = False) -> torch.Tensor:  # type: ignore[override]
        entry = _FIX.get(id(self))
        if entry is not None and entry[0]() is self and isinstance(src, torch.Tensor) and not _fits(src, self):
            src = entry[1](self, src)
        return super().copy_(src, non_blocking)

    def __repr__(self) -> str:  # as an nn.Parameter's (not "Parameter(HeldElsewhere(...))")
        return "Parameter containing:\n" + torch.Tensor._make_subclass(torch.Tensor, self.detach(), self.requires_grad).__repr__()

    def __reduce_ex__(self, proto: int) -> Any:  # pickled as a plain nn.Parameter
        return nn.Parameter(self.data, self.requires_grad).__reduce_ex__(proto)


def _fits(src: torch.Tensor, dst: torch.Tensor) -> bool:
    """copy_ takes `src` as torch would: its shape broadcasts to `dst`'s."""
    try:
        return torch.broadcast_shapes(tuple(src.shape), tuple(dst.shape)) == tuple(dst.shape)
    except RuntimeError:
        return False


def guard_copies(params: Iterable[nn.Parameter], fix: Callable[[nn.Parameter, torch.Tensor], torch.Tensor]) -> None:
    """copy_ of a source that does not fit into one of `params` calls `fix(p, src)`, which returns
    what to copy instead or raises. A Parameter of the user's own subclass keeps torch's error."""
    for i in [i for i, (ref, _) in _FIX.items() if ref() is None]:
        del _FIX[i]
    for p in params:
        if type(p) is nn.Parameter:
            p.__class__ = HeldElsewhere
        if isinstance(p, HeldElsewhere):
            _FIX[id(p)] = (weakref.ref(p), fix)
