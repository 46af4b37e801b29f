"""Data helpers for data parallelism: each rank feeds `train_step` its own local batch."""

from __future__ import annotations

import os
from typing import Any, Iterable

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch.utils.data import DataLoader, DistributedSampler

from fxspeed.errors import ConfigError


def _rank_world(rank: int | None, world: int | None) -> tuple[int, int]:
    """This process's (rank, world size): the arguments, else the initialized process group, else
    the launcher's environment (RANK / WORLD_SIZE, set by `fxspeed run` and torchrun) so that a
    batch can be split before fxspeed.compile() joins the group, else (0, 1)."""
    if rank is None or world is None:
        if dist.is_available() and dist.is_initialized():
            r, w = dist.get_rank(), dist.get_world_size()
        elif "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            r, w = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        else:
            r, w = 0, 1
        rank = r if rank is None else rank
        world = w if world is None else world
    if world < 1 or not 0 <= rank < world:
        raise ConfigError(f"rank {rank} is not a rank of a world of {world} process(es)")
    return rank, world


def local_batch(batch: Any, rank: int | None = None, world: int | None = None) -> Any:
    """This rank's slice (along dim 0) of a global batch: a tensor, tuple, list or dict.

    Raises a clear error when the batch size is not divisible by the number of ranks.
    """
    rank, world = _rank_world(rank, world)
    leaves, spec = pytree.tree_flatten(batch)
    out = []
    for x in leaves:
        if isinstance(x, torch.Tensor) and x.dim() > 0:
            if x.shape[0] % world:
                raise ConfigError(f"a global batch of {x.shape[0]} rows cannot be split evenly across {world} ranks; "
                                  f"use a batch size divisible by {world}")
            n = x.shape[0] // world
            out.append(x[rank * n:(rank + 1) * n])
        else:
            out.append(x)
    return pytree.tree_unflatten(out, spec)


def shard_loader(loader: DataLoader, rank: int | None = None, world: int | None = None, *,
                 shuffle: bool = True, seed: int = 0) -> DataLoader:
    """The same DataLoader, reading only this rank's share of the dataset (DistributedSampler)."""
    rank, world = _rank_world(rank, world)
    sampler = DistributedSampler(loader.dataset, num_replicas=world, rank=rank, shuffle=shuffle, seed=seed,
                                 drop_last=True)
    return DataLoader(loader.dataset, batch_size=loader.batch_size, sampler=sampler, num_workers=loader.num_workers,
                      collate_fn=loader.collate_fn, drop_last=True)


def iterate_local(batches: Iterable[Any], rank: int | None = None, world: int | None = None) -> Iterable[Any]:
    for b in batches:
        yield local_batch(b, rank, world)
