"""The optimizer step inside backward: what a program compiled with PassOptions.optimizer_store
calls (passes/memory/step_in_backward.py puts the calls there).

    fxspeed::step_parameters(store, names, params, grads)
      -> the engine's optimizer steps exactly these parameters with these gradients, now

    fxspeed::step_buckets(store, buckets, params, grads)
      -> the same for whole gradient buckets of the engine's flat layout (runtime/flat_parameters.py):
         grads[i] is bucket buckets[i] as the reduction left it (the whole reduced bucket, or this
         rank's shard of it); the optimizer steps what it steps for those buckets, now

The gradients are the program's own values; once the call returns nothing reads them, so they
are freed there (FX code drops a value after its last reader) instead of living to the end of
backward as outputs. The update is torch.optim's own `step()` with only these parameters'
`.grad` set: the same kernel, the same states, the same step counters as one step at the end, so
the result is bit for bit the same. The engine registers an `InBackwardSteps` under the store's
name and calls `begin()` before each run.
why: docs/decisions/step-in-backward.md
"""

from __future__ import annotations

from typing import Protocol

import torch

from fxspeed.errors import FxspeedError
from fxspeed.runtime.named_stores import NamedStores
from fxspeed.runtime.offloaded_optimizer import OffloadedAdam

_STEPPERS: "NamedStores[InBackwardSteps]" = NamedStores("steps its optimizer through")


def in_layout_of(p: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """`g` with `p`'s strides. The graph's gradient may come out in another layout (a
    channels_last conv weight's gradient, a transposed view's); torch's fused and foreach
    optimizers pair parameter and gradient elements by memory position, so a mismatch updates
    the wrong elements without an error. Eager autograd keeps the same contract (AccumulateGrad)."""
    if g.stride() == p.stride() or p.numel() <= 1:
        return g
    return torch.empty_like(p, dtype=g.dtype).copy_(g)


class FlatLayout(Protocol):
    """What bucket steps need of runtime/flat_parameters.FlatParameters."""

    def set_grads(self, reduced: dict[int, torch.Tensor]) -> None: ...

    def bucket_tensors(self, k: int) -> list[torch.Tensor]: ...


class InBackwardSteps:
    """Steps named parameters (or, with `flat`, gradient buckets) of one engine with `optimizer`
    while its program runs."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: dict[str, torch.Tensor],
                 flat: FlatLayout | None = None) -> None:
        self.optimizer = optimizer
        self.params = params
        self.flat = flat
        self.stepped: set[int] = set()  # ids of the parameters (or bucket indices) stepped in this run
        self.calls = 0

    def begin(self) -> None:
        """A new step: nothing stepped yet."""
        self.stepped.clear()

    @torch.no_grad()
    def step(self, names: list[str], grads: list[torch.Tensor]) -> None:
        live = []
        for name, g in zip(names, grads):
            p = self.params[name]
            if id(p) in self.stepped or p.grad is not None:
                # One Parameter under two names (tied weights the graph did not merge): a second
                # update would apply Adam twice. Never silently.
                raise FxspeedError(f"parameter {name!r} was given two gradients in one step (is it tied to another "
                                   "name?); compile with Config(disable_passes=('step_in_backward',)), or keep "
                                   "'dedupe_tied_parameters' enabled")
            p.grad = in_layout_of(p, g)
            live.append(p)
        try:
            self._step(live)
        finally:
            for p in live:
                p.grad = None
                self.stepped.add(id(p))
        self.calls += 1

    def _step(self, live: list[torch.Tensor]) -> None:
        if isinstance(self.optimizer, OffloadedAdam):  # the chunks holding these tensors, not every chunk
            self.optimizer.step(only=live)
        else:  # torch.optim steps the tensors that have a gradient
            self.optimizer.step()

    @torch.no_grad()
    def step_buckets(self, buckets: list[int], grads: list[torch.Tensor]) -> None:
        if self.flat is None:
            raise FxspeedError("a program steps gradient buckets, but its engine's optimizer does not step a flat "
                               "layout; compile with Config(disable_passes=('step_buckets_in_backward',))")
        live: list[torch.Tensor] = []
        for k in buckets:
            if k in self.stepped:
                raise FxspeedError(f"gradient bucket {k} was stepped twice in one step; compile with "
                                   "Config(disable_passes=('step_buckets_in_backward',)) and report this program")
            live += self.flat.bucket_tensors(k)
        self.flat.set_grads(dict(zip(buckets, grads)))
        try:
            self._step(live)
        finally:
            for t in live:
                t.grad = None
            self.stepped.update(buckets)
        self.calls += 1


def register(name: str, steps: InBackwardSteps) -> None:
    """Make `steps` what programs compiled with PassOptions.optimizer_store=`name` call."""
    _STEPPERS.register(name, steps)


# Defined by schema: custom_op cannot infer a list of strings (the parameter names).
torch.library.define("fxspeed::step_parameters",
                     "(str store, str[] names, Tensor(a!)[] params, Tensor[] grads) -> ()")


@torch.library.impl("fxspeed::step_parameters", "CompositeExplicitAutograd")
def step_parameters(store: str, names: list[str], params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
    """Step `params` (the parameters called `names`) with `grads`, by the optimizer registered
    under `store`. `params` are in the call so the graph says what it mutates."""
    _STEPPERS.get(store).step(list(names), list(grads))


@torch.library.register_fake("fxspeed::step_parameters")
def _step_parameters_fake(store: str, names: list[str], params: list[torch.Tensor],
                          grads: list[torch.Tensor]) -> None:
    return None


torch.library.define("fxspeed::step_buckets",
                     "(str store, int[] buckets, Tensor(a!)[] params, Tensor[] grads) -> ()")


@torch.library.impl("fxspeed::step_buckets", "CompositeExplicitAutograd")
def step_buckets(store: str, buckets: list[int], params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
    """Step gradient buckets `buckets` (reduced values `grads`) by the optimizer registered under
    `store`. `params` are the program inputs the update writes (the buckets' parameters, or their
    shards), in the call so the graph says what it mutates."""
    _STEPPERS.get(store).step_buckets(list(buckets), list(grads))


@torch.library.register_fake("fxspeed::step_buckets")
def _step_buckets_fake(store: str, buckets: list[int], params: list[torch.Tensor],
                       grads: list[torch.Tensor]) -> None:
    return None


step_parameters_op = torch.ops.fxspeed.step_parameters.default
step_buckets_op = torch.ops.fxspeed.step_buckets.default
