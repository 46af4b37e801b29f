"""A batch as the compiler and the runtime see it: its cache key, its tensor leaves, and its
split into micro-batches along dim 0."""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree

from fxspeed.errors import ConfigError


def split_inputs(args: tuple, kwargs: dict) -> tuple[list[Any], pytree.TreeSpec]:
    leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
    return leaves, spec


def input_key(args: tuple, kwargs: dict) -> tuple:
    """Hashable description of a batch: structure, tensor shapes/dtypes/devices, other values.

    A batch with another key needs another trace; the engine caches traces by this key, so a
    new shape retraces once and is then reused.
    """
    leaves, spec = split_inputs(args, kwargs)
    parts = []
    for x in leaves:
        if isinstance(x, torch.Tensor):
            parts.append(("T", tuple(x.shape), x.dtype, x.device.type))
        else:
            try:
                hash(x)
                parts.append(("C", x))
            except TypeError:
                parts.append(("C", repr(x)))
    return (str(spec), tuple(parts))


def tensor_leaves(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    leaves, _ = split_inputs(args, kwargs)
    return [x for x in leaves if isinstance(x, torch.Tensor)]


def split_batch(args: tuple, kwargs: dict, k: int, key: str = "microbatches") -> list[tuple[tuple, dict]]:
    """Split every tensor of the batch into `k` equal chunks along dim 0 (non-tensors repeat).
    `key` names the Config field asking for the split, for the error."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    for x in leaves:
        if isinstance(x, torch.Tensor) and (x.dim() == 0 or x.shape[0] % k):
            raise ConfigError(f"Config.{key}={k} must divide the batch dimension; got a tensor of shape "
                              f"{tuple(x.shape)}. Use a batch size divisible by {k} or change {key} "
                              f"(a divisor of {x.shape[0] if x.dim() else 'the batch size'})")
    if k == 1:
        return [(args, kwargs)]
    chunks = [x.chunk(k) if isinstance(x, torch.Tensor) else [x] * k for x in leaves]
    return [pytree.tree_unflatten([c[i] for c in chunks], spec) for i in range(k)]
