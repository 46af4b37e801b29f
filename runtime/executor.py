"""StepExecutor: binds a Program to live tensors and runs it.

    outputs = gm(*params, *buffers, *batch)
    -> buffer updates copied into the module's buffers (BatchNorm running stats)
    -> gradients handed back by parameter name, the loss as a tensor

The argument list is built once; a step only splices the batch in, so there is no per-step
Python work proportional to the model beyond the generated graph code itself.
"""

from __future__ import annotations

from typing import Any

import torch

from .program import Program


class StepExecutor:
    def __init__(self, program: Program, params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor]):
        self.program = program
        sig = program.signature
        self._fixed: list[torch.Tensor | None] = []
        self._batch_slots: list[int] = []
        for i, spec in enumerate(sig.inputs):
            if spec.kind == "param":
                self._fixed.append(params[spec.target])
            elif spec.kind == "buffer":
                self._fixed.append(buffers[spec.target])
            else:
                self._fixed.append(None)
                self._batch_slots.append(i)
        self._buffer_updates = [(i, buffers[s.target]) for i, s in enumerate(sig.outputs) if s.kind == "buffer_update"]
        self._grads = [(i, s.target) for i, s in enumerate(sig.outputs) if s.kind == "grad"]
        self._loss = next((i for i, s in enumerate(sig.outputs) if s.kind == "loss"), None)
        self._user = [i for i, s in enumerate(sig.outputs) if s.kind == "output"]

    def run(self, batch: list[torch.Tensor]) -> tuple[torch.Tensor | None, dict[str, torch.Tensor], list[Any]]:
        """Run once; returns (loss, grads by parameter name, user outputs)."""
        if len(batch) != len(self._batch_slots):
            raise ValueError(f"program expects {len(self._batch_slots)} batch tensors, got {len(batch)}")
        args = list(self._fixed)
        for slot, t in zip(self._batch_slots, batch):
            args[slot] = t
        with torch.no_grad():
            outs = self.program.gm(*args)
            for i, buf in self._buffer_updates:
                if outs[i] is not buf:
                    buf.copy_(outs[i])
        grads = {name: outs[i] for i, name in self._grads}
        loss = outs[self._loss] if self._loss is not None else None
        return loss, grads, [outs[i] for i in self._user]
