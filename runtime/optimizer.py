"""Optimizers: torch.optim itself, over whatever tensors this rank owns.

Using torch.optim means fxspeed's AdamW/Adam/SGD are torch.optim's own update rules; sharded
ranks run the same optimizer over their flat shards (as ZeRO does). fxspeed asks for torch's
fused kernels (one pass over each tensor; on CPU since torch 2.4, on CUDA) and falls back to the
default implementation where they are not supported (another device, a non-float tensor).
With Config.offload="optimizer" the Adam moments live in files (runtime/offloaded_optimizer.py),
stepped by the same fused kernel.
why: docs/decisions/fused-optimizers.md
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

import torch

from fxspeed.runtime.offloaded_optimizer import OffloadedAdam


@dataclass(frozen=True)
class OptimizerSpec:
    name: str = "adamw"
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    momentum: float = 0.0
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    total_steps: int | None = None
    # Config.offload="optimizer" with states in files: the directory (Config.nvme_path) and this
    # rank's name for its swap directory; None keeps the states in memory.
    swap_root: str | None = None
    swap_name: str = "rank0"
    chunk_bytes: int = 64 * 2**20
    offload_bytes: int | None = None  # None: every state to the file; else at least this many bytes
    masters: bool = False  # the tensors are working copies; their fp32 masters go to the file too
    # positions in the tensor list where a new chunk of the file begins (the first tensor of each
    # gradient bucket, when the program steps buckets inside backward: no chunk spans two)
    chunk_starts: tuple[int, ...] = ()


def build_optimizer(params: Iterable[torch.Tensor], spec: OptimizerSpec) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    params = list(params)
    if spec.swap_root is not None:
        if spec.name not in ("adamw", "adam"):
            raise ValueError(f"optimizer offload steps Adam/AdamW only, not {spec.name!r}")
        opt: torch.optim.Optimizer = OffloadedAdam(params, lr=spec.lr, betas=spec.betas, eps=spec.eps,
                                                   weight_decay=spec.weight_decay, decoupled=spec.name == "adamw",
                                                   swap_root=spec.swap_root, name=spec.swap_name,
                                                   chunk_bytes=spec.chunk_bytes, offload_bytes=spec.offload_bytes,
                                                   masters=spec.masters, chunk_starts=spec.chunk_starts)
    elif spec.name in ("adamw", "adam"):
        cls = torch.optim.AdamW if spec.name == "adamw" else torch.optim.Adam
        opt = _fused(cls, params, lr=spec.lr, betas=spec.betas, eps=spec.eps, weight_decay=spec.weight_decay)
    elif spec.name == "sgd":
        opt = _fused(torch.optim.SGD, params, lr=spec.lr, momentum=spec.momentum, weight_decay=spec.weight_decay)
    else:
        raise ValueError(f"unknown optimizer {spec.name!r}; accepted: 'adamw', 'adam', 'sgd'")
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(spec))


def _fused(cls: type[torch.optim.Optimizer], params: list[torch.Tensor], **kw: object) -> torch.optim.Optimizer:
    """`cls` with torch's fused kernel where every tensor supports it, else its default implementation."""
    if any(p.is_complex() for p in params):  # accepted at construction, refused at the first step
        return cls(params, **kw)
    try:
        return cls(params, fused=True, **kw)
    except (RuntimeError, ValueError, TypeError):  # unsupported device / dtype, or no `fused` argument
        return cls(params, **kw)


def lr_lambda(spec: OptimizerSpec):  # noqa: ANN201 - returns a step -> factor function
    """Learning-rate factor per step: linear warmup, then constant / linear / cosine decay to 0."""
    warm, total, kind = spec.warmup_steps, spec.total_steps, spec.lr_schedule

    def factor(step: int) -> float:
        if kind == "manual":  # the user sets the lr; the engine never steps this schedule
            return 1.0
        if warm and step < warm:
            return (step + 1) / warm
        if kind == "constant" or total is None:
            return 1.0
        progress = min(1.0, (step - warm) / max(1, total - warm))
        return 1.0 - progress if kind == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor
