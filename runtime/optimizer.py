"""Optimizers: torch.optim itself, over whatever tensors this rank owns.

Using torch.optim (foreach implementations) means fxspeed's AdamW/Adam/SGD are numerically
the same as their torch.optim twins by construction; later, sharded ranks run the same
optimizer over their flat shards (as ZeRO does).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

import torch


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


def build_optimizer(params: Iterable[torch.Tensor], spec: OptimizerSpec) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    params = list(params)
    if spec.name == "adamw":
        opt: torch.optim.Optimizer = torch.optim.AdamW(params, lr=spec.lr, betas=spec.betas, eps=spec.eps,
                                                       weight_decay=spec.weight_decay)
    elif spec.name == "adam":
        opt = torch.optim.Adam(params, lr=spec.lr, betas=spec.betas, eps=spec.eps, weight_decay=spec.weight_decay)
    elif spec.name == "sgd":
        opt = torch.optim.SGD(params, lr=spec.lr, momentum=spec.momentum, weight_decay=spec.weight_decay)
    else:
        raise ValueError(f"unknown optimizer {spec.name!r}; accepted: 'adamw', 'adam', 'sgd'")
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(spec))


def lr_lambda(spec: OptimizerSpec):  # noqa: ANN201 - returns a step -> factor function
    """Learning-rate factor per step: linear warmup, then constant / linear / cosine decay to 0."""
    warm, total, kind = spec.warmup_steps, spec.total_steps, spec.lr_schedule

    def factor(step: int) -> float:
        if warm and step < warm:
            return (step + 1) / warm
        if kind == "constant" or total is None:
            return 1.0
        progress = min(1.0, (step - warm) / max(1, total - warm))
        return 1.0 - progress if kind == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor
