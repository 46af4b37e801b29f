"""The engine's side of tensor parallelism: Parameters that hold this tp rank's slice.

After the first training program is compiled, every parameter the program takes as a
"param_tp" input (signature.tp_layout: name -> (dim, blocks)) is cut down to this rank's slice
in place (`Parameter.data`), so the optimizer, gradients and memory are per slice. Full
tensors come back by all-gathering over the tp group: for `state_dict`/`save` and while the
engine traces another program (the tracer needs the full shapes).

Slice layout (the same one passes/parallel/shard_tensors.py takes in the graph): the dim is read
as `blocks` equal blocks, each split into T contiguous pieces; rank t holds piece t of every
block, concatenated. A layout `(dim, (blocks, rep))` splits each block into T / rep pieces only,
piece k held by the `rep` ranks k*rep .. k*rep+rep-1 (rank t: piece t // rep): grouped-query
attention's key/value weights with fewer key/value heads than ranks. Their full value is rebuilt
from one copy of each piece; their gradients are equal on the ranks of a group (the program
all-reduces them), so the clip norm counts them on the group's first rank only.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn

from fxspeed.runtime.host_memory import release_freed_host_memory



def split_of(blocks: int | tuple[int, int]) -> tuple[int, int]:
    """(blocks, rep) from a layout's second entry: `blocks`, or `(blocks, rep)` for a split over
    groups of `rep` ranks."""
    return (int(blocks[0]), int(blocks[1])) if isinstance(blocks, (tuple, list)) else (int(blocks), 1)


def take_slice(full: torch.Tensor, dim: int, blocks: int | tuple[int, int], rank: int, T: int) -> torch.Tensor:
    """Rank `rank`'s slice of `full`, in a storage of its own: a row slice is already contiguous,
    and `.contiguous()` would return a view that keeps the whole tensor's storage alive (each S(0)
    Parameter held its full weight: 134 MB per rank on the 109M benchmark GPT)."""
    blocks, rep = split_of(blocks)
    T, rank = T // rep, rank // rep
    n = full.shape[dim]
    m = n // (blocks * T)
    pieces = [full.narrow(dim, k * (n // blocks) + rank * m, m) for k in range(blocks)]
    return torch.cat(pieces, dim) if blocks > 1 else pieces[0].clone(memory_format=torch.contiguous_format)


def join_slices(parts: list[torch.Tensor], dim: int, blocks: int | tuple[int, int]) -> torch.Tensor:
    """The full tensor from every rank's slice (rank order; of a split over groups, one copy of
    each piece is used: the first rank's of each group)."""
    blocks, rep = split_of(blocks)
    parts = parts[::rep]
    if blocks == 1:
        return torch.cat(parts, dim)
    per = [p.chunk(blocks, dim) for p in parts]
    return torch.cat([per[r][k] for k in range(blocks) for r in range(len(parts))], dim)


class TensorParallelParameters:
    """The Parameters sliced over the tp group, and how to get their full values back."""

    def __init__(self, group: Any, rank: int, size: int):
        self.group, self.rank, self.size = group, rank, size
        # id -> (p, dim, blocks, full); blocks is (blocks, rep) for a split over groups of ranks
        self.layout: dict[int, tuple[nn.Parameter, int, Any, tuple[int, ...]]] = {}

    def __bool__(self) -> bool:
        return bool(self.layout)

    def apply(self, params: dict[str, nn.Parameter], layout: dict[str, tuple[int, int]],
              make: Callable[[list[nn.Parameter]], list[torch.Tensor]] | None = None) -> None:
        """Cut each Parameter in `layout` to this rank's slice (once; later programs reuse it).

        `make` (a model built on the meta device: DeferredInit.materialize): gives a Parameter's
        init group its full values and returns the tensors it made; each is cut as soon as its
        group is made, so the full tensors of one group are alive at a time, never the model's."""
        entry = {id(params[name]): (dim, blocks) for name, (dim, blocks) in layout.items()}
        cut_on_cpu = False
        for name in layout:
            p = params[name]
            if id(p) in self.layout:
                continue
            made = make([p]) if make is not None else []
            for t in (p, *made):
                if id(t) not in entry or id(t) in self.layout:
                    continue  # (a tensor of the group that stays whole, or cut already)
                dim, blocks = entry[id(t)]
                full_shape = tuple(t.shape)
                with torch.no_grad():
                    t.data = take_slice(t.data, dim, blocks, self.rank, self.size)
                self.layout[id(t)] = (t, dim, blocks, full_shape)
                cut_on_cpu |= t.device.type == "cpu"
        if cut_on_cpu:
            release_freed_host_memory()

    def forget(self, p: torch.Tensor) -> tuple[int, ...] | None:
        """Take `p` out of the layout (a pipeline stage's weight this rank does not hold); its full
        shape, or None if it was not sliced."""
        e = self.layout.pop(id(p), None)
        return e[3] if e else None

    def slice_shape(self, p: torch.Tensor) -> tuple[int, ...] | None:
        """The shape of this rank's slice of sliced Parameter `p` (whatever `p` holds now)."""
        e = self.layout.get(id(p))
        if e is None:
            return None
        _, dim, blocks, full = e
        pieces = self.size // split_of(blocks)[1]
        return tuple(n // pieces if d == dim else n for d, n in enumerate(full))

    def adopt_reassigned(self) -> list[nn.Parameter]:
        """Sliced Parameters given another tensor outside `gathered()` (`p.data = t`: weights
        loaded by hand). One of the full shape is cut to this rank's slice, as `gathered()`'s
        write-back would take it (the programs read the slice's shape: a whole weight failed
        inside the step with a bare reshape error and left the ranks out of step); the
        Parameters holding any other shape are returned."""
        other = []
        for p, dim, blocks, full in self.layout.values():
            shape = tuple(p.shape)
            if shape == self.slice_shape(p):
                continue
            if shape == full:
                with torch.no_grad():
                    p.data = take_slice(p.data, dim, blocks, self.rank, self.size)
            else:
                other.append(p)
        return other

    def full_shape(self, p: torch.Tensor) -> tuple[int, ...] | None:
        e = self.layout.get(id(p))
        return e[3] if e else None

    def full(self, p: torch.Tensor) -> torch.Tensor:
        """The full value of a sliced Parameter (collective over the tp group); others as they are."""
        e = self.layout.get(id(p))
        if e is None:
            return p.detach()
        _, dim, blocks, _ = e
        parts = [torch.empty_like(p.data) for _ in range(self.size)]
        dist.all_gather(parts, p.data.contiguous(), group=self.group)
        return join_slices(parts, dim, blocks)

    def gather_like(self, p: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """The full value of `t`, a tensor laid out like sliced Parameter `p`'s slice (an optimizer
        state, or the slice itself gathered from ZeRO-3 shards while `p` holds nothing); anything
        else as it is. Collective over the tp group when p is sliced."""
        e = self.layout.get(id(p))
        if e is None or not torch.is_tensor(t) or tuple(t.shape) != self.slice_shape(p):
            return t
        parts = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(parts, t.contiguous(), group=self.group)
        return join_slices(parts, e[1], e[2])

    def local(self, p: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a full value for Parameter `p` (full as is when p is not sliced)."""
        e = self.layout.get(id(p))
        if e is None or not torch.is_tensor(full) or tuple(full.shape) != e[3]:
            return full
        return take_slice(full, e[1], e[2], self.rank, self.size)

    @contextlib.contextmanager
    def gathered(self, write_back: bool = False) -> Iterator[None]:
        """Inside: every sliced Parameter holds its full value (collective); restored on exit.
        `write_back`: what the full values hold at a normal exit goes into this rank's slices
        (writes inside are kept)."""
        if not self.layout:
            yield
            return
        saved = {}
        for pid, (p, *_rest) in self.layout.items():
            saved[pid] = p.data
            full = self.full(p)
            p.data = full
        done = False
        try:
            yield
            done = True
        finally:
            with torch.no_grad():
                for pid, (p, *_rest) in self.layout.items():
                    if done and write_back:
                        saved[pid].copy_(self.local(p, p.data))
                    p.data = saved[pid]
            del saved
            if any(p.device.type == "cpu" for p, *_rest in self.layout.values()):
                release_freed_host_memory()  # the gathered copies

    def counted(self, p: torch.Tensor) -> bool:
        """Whether this rank counts sliced Parameter `p`'s gradient in a norm over the tp group: its
        own slice, or, of a slice its group of ranks shares, on the group's first rank."""
        e = self.layout.get(id(p))
        return e is not None and self.rank % split_of(e[2])[1] == 0

    def squared_norm(self, grads: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Sum of squared gradient entries over the whole model: slices summed over the tp group
        (a slice shared by a group of ranks once), replicated gradients counted once."""
        sliced = [g.float().pow(2).sum() for p, g in grads if self.counted(p)]
        whole = [g.float().pow(2).sum() for p, g in grads if id(p) not in self.layout]
        dev = grads[0][1].device if grads else torch.device("cpu")
        s = torch.stack(sliced).sum() if sliced else torch.zeros((), device=dev)
        dist.all_reduce(s, group=self.group)
        return s + (torch.stack(whole).sum() if whole else torch.zeros((), device=dev))
