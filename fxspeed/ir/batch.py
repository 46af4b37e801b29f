"""A batch as the compiler and the runtime see it: its cache key, its tensor leaves, and its
split into micro-batches along dim 0."""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree

from fxspeed.errors import ConfigError, short_repr


def split_inputs(args: tuple, kwargs: dict) -> tuple[list[Any], pytree.TreeSpec]:
    leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
    return leaves, spec


def input_key(args: tuple, kwargs: dict) -> tuple:
    """Hashable description of a batch: structure, tensor shapes/dtypes/devices, other values.

    A batch with another key needs another trace; the engine caches traces by this key, so a
    new shape retraces once and is then reused. The key holds each tensor's `traced_format`,
    not its strides or its aliasing: see `traced_format` for why that is enough.
    """
    leaves, spec = split_inputs(args, kwargs)
    parts = []
    for x in leaves:
        if isinstance(x, torch.Tensor):
            parts.append(("T", tuple(x.shape), x.dtype, x.device.type, _FORMAT_NAMES[traced_format(x)]))
        else:
            parts.append(_constant_key(x))
    return (str(spec), tuple(parts))


def describe_input_key(key: tuple) -> dict[str, str]:
    """An `input_key` in words, piece by piece (for an error naming which pieces differ between
    ranks): {"the batch's structure": ..., "batch value 0": "a tensor of shape (4, 8), int64 on cpu
    (contiguous)", ...}."""
    spec, leaves = key
    out = {"the batch's structure": short_repr(" ".join(spec.split()))}
    for i, leaf in enumerate(leaves):
        if leaf[0] == "T":
            _, shape, dtype, device, fmt = leaf
            out[f"batch value {i}"] = f"a tensor of shape {tuple(shape)}, {str(dtype).removeprefix('torch.')} " \
                                      f"on {device} ({fmt})"
        else:
            out[f"batch value {i}"] = short_repr(leaf[-1])
    return out


def _constant_key(x: Any) -> tuple:
    """A non-tensor batch value is baked into the trace, so its key must tell apart every value
    a trace could differ on: by type (0, 0.0 and False are equal in Python) and, for floats, by
    bits (-0.0 == 0.0). A value with no faithful key (a numpy array's repr elides its middle) is
    refused rather than risk reusing a trace made for another value."""
    if isinstance(x, float):
        return ("C", type(x).__qualname__, x.hex())
    try:
        hash(x)
    except TypeError:
        raise ConfigError(f"a batch value of type {type(x).__qualname__} is neither a tensor nor hashable: fxspeed "
                          "bakes non-tensor values into the compiled step and needs to tell one from another. "
                          "Pass it as a tensor (torch.as_tensor(...)) or keep it on the model") from None
    return ("C", type(x).__qualname__, x)


def traced_format(x: torch.Tensor) -> torch.memory_format:
    """The memory format a batch tensor is traced in, and the one it is fed to the graph in.

    Rule (the layout half of the cache key): a graph is traced on batch tensors that are fresh,
    dense and independent -- contiguous, or channels_last (4-D) / channels_last_3d (5-D) when
    the tensor is in that format and not plainly contiguous -- never on the example's own
    strides or storage. So aliasing between inputs (`(x, x)`, `dict(input_ids=ids,
    labels=ids)`, `d[:, :-1]` and `d[:, 1:]`) is never baked into a graph, and a traced `view`
    never meets strides it was not traced for: `tensor_leaves` makes any other layout match
    (one copy, only when the layout differs, e.g. a sliced LM batch)."""
    if x.layout != torch.strided or x.is_contiguous():
        return torch.contiguous_format
    if x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    if x.dim() == 5 and x.is_contiguous(memory_format=torch.channels_last_3d):
        return torch.channels_last_3d
    return torch.contiguous_format


_FORMAT_NAMES = {torch.contiguous_format: "contiguous", torch.channels_last: "channels_last",
                 torch.channels_last_3d: "channels_last_3d"}


def tensor_leaves(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The batch's tensors as a traced graph takes them: each in its `traced_format` (a copy
    only for a tensor not already dense in it)."""
    leaves, _ = split_inputs(args, kwargs)
    out = []
    for x in leaves:
        if isinstance(x, torch.Tensor):
            fmt = traced_format(x)
            dense = x.layout != torch.strided or x.is_contiguous(memory_format=fmt)
            out.append(x if dense else x.contiguous(memory_format=fmt))
    return out


def split_batch(args: tuple, kwargs: dict, k: int, key: str = "microbatches") -> list[tuple[tuple, dict]]:
    """Split every tensor of the batch into `k` equal chunks along dim 0 (0-dim tensors and
    non-tensors repeat). `key` names the Config field asking for the split, for the error.

    Every tensor with a dim 0 must have the batch's number of rows: a tensor that is not
    per-sample (a (2, 1, 8) weight broadcast against a (4, 8) batch) would be split as if it
    were, silently, so it is refused with its place in the batch named."""
    if k == 1:
        return [(args, kwargs)]
    paths, spec = pytree.tree_flatten_with_path((args, kwargs))
    leaves = [x for _, x in paths]
    rows = [(("args" if p[0].idx == 0 else "kwargs") + pytree.keystr(p[1:]), x.shape[0])
            for p, x in paths if isinstance(x, torch.Tensor) and x.dim() > 0]
    for where, n in rows:
        if n != rows[0][1]:
            raise ConfigError(f"Config.{key}={k} splits every batch tensor along dim 0, but {where} has {n} rows "
                              f"and {rows[0][0]} has {rows[0][1]}: a tensor that is not per-sample would be "
                              "split as if it were. Keep such tensors on the model (an attribute or buffer) or give "
                              "every batch tensor the same number of rows")
        if n % k:
            raise ConfigError(f"Config.{key}={k} must divide the batch dimension; got {where} with {n} rows. "
                              f"Use a batch size divisible by {k} or change {key} (a divisor of {n}); a DataLoader's last, "
                              "smaller batch: build it with drop_last=True")
    chunks = [x.chunk(k) if isinstance(x, torch.Tensor) and x.dim() > 0 else [x] * k for x in leaves]
    return [pytree.tree_unflatten([c[i] for c in chunks], spec) for i in range(k)]


def key_change(old: tuple, args: tuple, kwargs: dict) -> str:
    """What differs between the batch (args, kwargs) and the `input_key` `old` it was compiled
    for, each value named by its place ("args[0]: a tensor of shape (4, 16) ..., compiled for
    (8, 16) ..."), for an engine that cannot trace again (a pipeline); "" where nothing does."""
    new = input_key(args, kwargs)
    paths = [("args" if p[0].idx == 0 else "kwargs") + pytree.keystr(p[1:])
             for p, _ in pytree.tree_flatten_with_path((tuple(args), dict(kwargs)))[0]]
    if new[0] != old[0]:
        return f"the batch holds {', '.join(paths) or 'nothing'}; it was compiled for another structure " \
               f"({len(old[1])} values: {short_repr(' '.join(old[0].split()))})"
    was, now = describe_input_key(old), describe_input_key(new)
    return "; ".join(f"{path}: {now[k]}, compiled for {was[k]}"
                     for path, k in zip(paths, (f"batch value {i}" for i in range(len(paths)))) if now[k] != was[k])


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def batch_digest(args: tuple, kwargs: dict) -> list[Any]:
    """A cheap digest of a batch's contents: per tensor its shape, dtype and three int64 sums of
    its bits (all elements, the first half, the last two thirds: contiguous runs, which reduce
    at memory speed; strided ones took 3x as long). Exact integer arithmetic, so equal batches
    give equal digests on any rank and thread count (a float sum's order could differ);
    different ones almost surely differ. Non-tensor leaves by repr."""
    leaves, _ = split_inputs(args, kwargs)
    out: list[Any] = []
    sums = []
    for x in leaves:
        if not isinstance(x, torch.Tensor):
            out.append(repr(x))
            continue
        out.append((tuple(x.shape), str(x.dtype)))
        if x.layout != torch.strided or x.numel() == 0:
            continue
        bits = x.detach().contiguous().reshape(-1)
        if bits.dtype == torch.bool or bits.is_floating_point() or bits.is_complex():
            bits = bits.view(_INT_OF_SIZE.get(bits.element_size(), torch.uint8))
        n = bits.numel()
        sums.append(torch.stack([bits.sum(dtype=torch.int64), bits[:n // 2].sum(dtype=torch.int64),
                                 bits[n // 3:].sum(dtype=torch.int64)]).cpu())
    return out + (torch.cat(sums).tolist() if sums else [])  # one device sync for all of them
