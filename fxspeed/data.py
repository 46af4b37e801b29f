"""Data helpers for data parallelism: each rank feeds `train_step` its own local batch."""

from __future__ import annotations

import logging
import os
from typing import Any, Iterable

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, RandomSampler, SequentialSampler

from fxspeed.errors import ConfigError

log = logging.getLogger("fxspeed")


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
                 shuffle: bool | None = None, seed: int = 0) -> DataLoader:
    """`loader` reading only this rank's share of its dataset (a DistributedSampler), as under DDP:
    its batch_size is each rank's batch (the global batch is world x batch_size; `iterate_local`
    instead splits global batches). Its shuffling (or `shuffle=`), drop_last, collate_fn and worker
    settings are kept; call `.sampler.set_epoch(epoch)` each epoch for a new order. With
    drop_last=False the sampler repeats a few rows so every rank gets as many (the ranks' last
    batches then have one shape, which every rank's step needs). A custom sampler or batch_sampler,
    or an IterableDataset, cannot be split this way: refused."""
    rank, world = _rank_world(rank, world)
    if isinstance(loader.dataset, IterableDataset):
        raise ConfigError("shard_loader: the DataLoader reads an IterableDataset, which has no indices to split over "
                          "ranks; have each rank's dataset yield its own share (e.g. by rank and world size), or split "
                          "global batches with fxspeed.data.iterate_local")
    if loader.batch_size is None:
        raise ConfigError("shard_loader: the DataLoader batches with a batch_sampler, which cannot be split over "
                          "ranks; give it batch_size= (each rank's batch), or shard the batch_sampler's indices "
                          "yourself")
    if shuffle is None:
        if not isinstance(loader.sampler, (RandomSampler, SequentialSampler)):
            raise ConfigError(f"shard_loader: the DataLoader samples with a {type(loader.sampler).__name__}, which "
                              "would be replaced by an even split over ranks; give each rank its own sampler over its "
                              "share instead (or pass shuffle=True/False to split the dataset in that order anyway)")
        shuffle = isinstance(loader.sampler, RandomSampler)
    sampler = DistributedSampler(loader.dataset, num_replicas=world, rank=rank, shuffle=shuffle, seed=seed,
                                 drop_last=loader.drop_last)
    if loader.drop_last and len(sampler) < loader.batch_size:
        log.warning("fxspeed: shard_loader: each rank gets %d rows a pass, fewer than batch_size=%d, and the loader "
                    "drops its last incomplete batch: an epoch gives no batch at all", len(sampler), loader.batch_size)
    workers = dict(num_workers=loader.num_workers, pin_memory=loader.pin_memory, timeout=loader.timeout,
                   worker_init_fn=loader.worker_init_fn, multiprocessing_context=loader.multiprocessing_context)
    if loader.num_workers > 0:
        workers.update(persistent_workers=loader.persistent_workers, prefetch_factor=loader.prefetch_factor)
    return DataLoader(loader.dataset, batch_size=loader.batch_size, sampler=sampler, collate_fn=loader.collate_fn,
                      drop_last=loader.drop_last, **workers)


def iterate_local(batches: Iterable[Any], rank: int | None = None, world: int | None = None) -> Iterable[Any]:
    """This rank's slice of each global batch (`local_batch`): a global batch of B rows gives each
    of the world's ranks B / world rows."""
    for b in batches:
        yield local_batch(b, rank, world)
