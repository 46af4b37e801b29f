"""Program: the contract between compiler and runtime for one rank.

A GraphModule whose inputs and outputs are described by a StepSignature. The runtime binds
the signature to tensors (parameters, buffers, the batch) and interprets the outputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.fx as fx
import torch.utils._pytree as pytree

from fxspeed.ir import StepSignature


@dataclass
class Program:
    gm: fx.GraphModule
    signature: StepSignature
    train: bool = True
    out_spec: pytree.TreeSpec | None = None  # eval programs without a loss: output structure

    def describe(self) -> dict[str, Any]:
        return {"nodes": len(self.gm.graph.nodes), "train": self.train, "signature": self.signature.to_dict()}
