"""StepExecutor: binds a Program to live tensors and runs it.

    outputs = gm(*inputs)         inputs bound by the signature: parameters (or ZeRO-3 shards),
                                  buffers, then the batch spliced in
    -> buffer updates copied into the module's buffers (BatchNorm running stats)
    -> loss, gradients by parameter name, reduced gradient buckets by index, user outputs

The argument list is built once; a step only splices the batch in, so there is no per-step
Python work proportional to the model beyond the generated graph code itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from fxspeed.ir import IOSpec

from fxspeed.ir.program import Program, graphs_draw_random


@dataclass
class StepOutputs:
    loss: torch.Tensor | None = None
    grads: dict[str, torch.Tensor] = field(default_factory=dict)
    grad_buckets: dict[int, torch.Tensor] = field(default_factory=dict)
    outputs: list[Any] = field(default_factory=list)


class StepExecutor:
    def __init__(self, program: Program, bind: Callable[[IOSpec], torch.Tensor]):
        """`bind` returns the live tensor for a non-batch input (param, buffer, param_shard), or an
        object whose `current()` gives it at each run (values that change between steps)."""
        self.program = program
        self.draws_random = graphs_draw_random(program.gm)  # dropout: tp ranks share generator states
        # the generators the model's modules hold (`self.gen`), found once by whoever made the
        # program (the engine, where it draws): one put in another's place retraces the step
        self.held_generators: list[torch.Generator] = []
        sig = program.signature
        self._fixed: list[torch.Tensor | None] = []
        self._batch_slots: list[int] = []
        for i, spec in enumerate(sig.inputs):
            if spec.kind == "input":
                self._fixed.append(None)
                self._batch_slots.append(i)
            else:
                self._fixed.append(bind(spec))
        self._buffer_updates = [(i, bind(IOSpec("buffer", s.target))) for i, s in enumerate(sig.outputs)
                                if s.kind == "buffer_update"]
        self._grads = [(i, s.target) for i, s in enumerate(sig.outputs) if s.kind == "grad"]
        names = [n for _, n in self._grads]
        if len(set(names)) != len(names):
            raise ValueError(f"program returns several gradients for one parameter name: {sorted(names)}")
        self._buckets = [(i, int(s.target)) for i, s in enumerate(sig.outputs) if s.kind == "grad_bucket"]
        self._loss = next((i for i, s in enumerate(sig.outputs) if s.kind == "loss"), None)
        self._user = [i for i, s in enumerate(sig.outputs) if s.kind == "output"]

    @property
    def updated_buffers(self) -> list[torch.Tensor]:
        """The live buffers a run writes (BatchNorm's running statistics)."""
        return [buf for _, buf in self._buffer_updates]

    def run(self, batch: list[torch.Tensor]) -> StepOutputs:
        if len(batch) != len(self._batch_slots):
            raise ValueError(f"program expects {len(self._batch_slots)} batch tensors, got {len(batch)}")
        args = [a.current() if hasattr(a, "current") else a for a in self._fixed]  # e.g. the loss scale
        for slot, t in zip(self._batch_slots, batch):
            args[slot] = t
        with torch.no_grad():
            outs = self.program.gm(*args)
            for i, buf in self._buffer_updates:
                if outs[i] is not buf:
                    buf.copy_(outs[i])
        return StepOutputs(
            loss=outs[self._loss] if self._loss is not None else None,
            grads={name: outs[i] for i, name in self._grads},
            grad_buckets={k: outs[i] for i, k in self._buckets},
            outputs=[outs[i] for i in self._user],
        )
