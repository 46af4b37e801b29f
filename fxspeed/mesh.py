"""Joining torch.distributed: the process group, rank facts, and compile-time agreement checks.

Under `torchrun` (or `fxspeed run`), compile() joins the group from the environment (NCCL on
CUDA, gloo on CPU), or uses the default group when the script already initialized one.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from fxspeed.errors import ConfigError


@dataclass
class DistContext:
    rank: int = 0
    world: int = 1
    group: Any = None
    group_name: str = ""

    @property
    def active(self) -> bool:
        return self.world > 1


def join(n_devices: int, timeout_s: float) -> DistContext:
    """Return the process group for `n_devices` ranks, initializing it from the environment."""
    if n_devices == 1 and not dist.is_initialized():
        return DistContext()
    if not dist.is_initialized():
        if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
            raise ConfigError(
                f"devices={n_devices} needs {n_devices} processes: launch with `fxspeed run -n {n_devices} script.py` "
                f"or `torchrun --nproc-per-node {n_devices} script.py` (or call torch.distributed.init_process_group first)"
            )
        backend = "nccl" if torch.cuda.is_available() and os.environ.get("FXSPEED_BACKEND") != "gloo" else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    world = dist.get_world_size()
    if world != n_devices:
        raise ConfigError(f"devices={n_devices} but the process group has {world} ranks; pass devices={world} "
                          f"or launch {n_devices} processes")
    group = dist.group.WORLD
    return DistContext(dist.get_rank(), world, group, group.group_name)


def fingerprint(*parts: Any) -> str:
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:16]


def check_agreement(ctx: DistContext, what: str, value: str, fix: str) -> None:
    """Raise on every rank when ranks disagree on `value` (a fingerprint of `what`)."""
    if not ctx.active:
        return
    values: list[Any] = [None] * ctx.world
    dist.all_gather_object(values, value, group=ctx.group)
    differ = [r for r, v in enumerate(values) if v != values[0]]
    if differ:
        raise ConfigError(f"ranks disagree on {what}: rank(s) {differ} differ from rank 0. {fix}")


def check_same_everywhere(ctx: DistContext, what: str, value: str, fix: str) -> None:
    """Cheap per-step agreement (one 2-element all-reduce): raise on every rank when ranks
    hold different `value`s, before they diverge into mismatched collectives."""
    if not ctx.active:
        return
    h = int(value[:15], 16)
    t = torch.tensor([h, -h], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=ctx.group)
    if int(t[0]) != h or -int(t[1]) != h:  # same result on every rank: all take this path
        check_agreement(ctx, what, value, fix)  # names the ranks that differ


def check_same_model(ctx: DistContext, model: Any, config: Any) -> None:
    """Every rank must build the same model (parameter names, shapes, dtypes) and Config."""
    shapes = [(n, tuple(p.shape), str(p.dtype)) for n, p in model.named_parameters()]
    check_agreement(ctx, "the model and config", fingerprint(type(model).__name__, shapes, config.to_dict()),
                    "every rank must build the same model (same parameter names, shapes, dtypes) and Config")
