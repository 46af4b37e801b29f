"""Reduce-scatter and all-gather built from point-to-point transfers, as asynchronous graph ops.

On gloo (CPU) the library's own reduce-scatter costs 1.8x an all-reduce of the same buffer and
its all-gather about one all-reduce, where each should cost half of one: the same transfers
issued as `isend`/`irecv` pairs (every rank sends each peer that peer's chunk, directly) cost
what they should. why: docs/decisions/zero-scatter-via-all-reduce-on-gloo.md (numbers).

    fxspeed::exchange_scatter(input[N*s], world, group) -> recv[(N-1)*s]
        sends chunk j of `input` to rank j of `group` and receives every peer's chunk
        `rank` of its input, in the peers' rank order (this rank's own chunk skipped). The
        reduce-scatter is then  input[rank*s:(rank+1)*s] + sum of the received chunks,
        computed by the graph after `wait_tensor(recv)`:

            r = exchange_scatter(flat, 2, g) ... w = wait_tensor(r); shard = add(flat[rank*s:(rank+1)*s], w)

        With 2 ranks that is a single add, so fp32 sums equal torch's collective bit for bit.
    fxspeed::exchange_gather(shard[s], world, group) -> out[N*s]
    fxspeed::exchange_gather_out(shard[s], world, group, *, out[N*s]) -> out
        all_gather_into_tensor(_out): this rank's shard copied into its slot (skipped when the
        shard already is that slot, as FlatParameters' shards are), each peer's received into
        its own slot.

Like the `_c10d_functional` collectives these return at once: the transfers run on gloo's
transport threads and are registered against the returned tensor, so `wait_tensor` of it
(or of any view of its storage) waits for them. Until then the input must not be written
(the sends read it in place) and the output must not be read. Each op has a fake
implementation, so passes can put it in graphs and FakeTensor tracing sees its shapes.

Tags: every call on a group takes the next tag of a per-group counter. All ranks run the same
program, so they issue the same calls in the same order and a receive matches only the send
of the same call, whatever else is in flight on the group.
"""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist

Tensor = torch.Tensor

_TAG_BASE = 1 << 20  # away from tag 0, which user code's plain send/recv use
_TAG_SPAN = 1 << 24
_counters: dict[str, "itertools.count[int]"] = {}


def _group(name: str) -> dist.ProcessGroup:
    return torch._C._distributed_c10d._resolve_process_group(name)


def _next_tag(name: str) -> int:
    counter = _counters.setdefault(name, itertools.count())
    return _TAG_BASE + next(counter) % _TAG_SPAN


class _Transfers(dist.Work):
    """The sends and receives of one exchange, waited for together (what `wait_tensor` calls)."""

    def __init__(self, works: list[dist.Work]):
        super().__init__()
        self._works = works

    def wait(self, timeout=None) -> bool:  # noqa: ANN001 (c10d passes a timedelta or nothing)
        works, self._works = self._works, []
        for w in works:
            w.wait()
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)


def _check(t: Tensor, world: int, what: str) -> int:
    if t.dim() != 1 or not t.is_contiguous():
        raise ValueError(f"fxspeed::{what}: expects a contiguous 1-D tensor, got shape {tuple(t.shape)}")
    if world < 2:
        raise ValueError(f"fxspeed::{what}: world={world}; use it only with two or more ranks")
    return t.numel()


def _register(out: Tensor, works: list[dist.Work]) -> None:
    torch._C._distributed_c10d._register_work(out, _Transfers(works))


def _exchange_scatter(input: Tensor, world: int, group: str) -> Tensor:
    n = _check(input, world, "exchange_scatter")
    if n % world:
        raise ValueError(f"fxspeed::exchange_scatter: {n} elements do not split into {world} equal chunks; "
                         "pad the input to a multiple of the world size")
    pg = _group(group)
    rank, s = pg.rank(), n // world
    if pg.size() != world:
        raise ValueError(f"fxspeed::exchange_scatter: group {group!r} has {pg.size()} ranks, not {world}")
    recv = torch.empty((world - 1) * s, dtype=input.dtype, device=input.device)
    tag = _next_tag(group)
    works, slot = [], 0
    for peer in range(world):
        if peer == rank:
            continue
        works.append(dist.irecv(recv[slot * s:(slot + 1) * s], group=pg, group_src=peer, tag=tag))
        works.append(dist.isend(input[peer * s:(peer + 1) * s], group=pg, group_dst=peer, tag=tag))
        slot += 1
    _register(recv, works)
    return recv


def _exchange_gather_into(shard: Tensor, world: int, group: str, out: Tensor) -> Tensor:
    s = _check(shard, world, "exchange_gather")
    if out.numel() != world * s or not out.is_contiguous():
        raise ValueError(f"fxspeed::exchange_gather_out: out has {out.numel()} elements, not {world} x {s}, "
                         "or is not contiguous")
    pg = _group(group)
    rank = pg.rank()
    if pg.size() != world:
        raise ValueError(f"fxspeed::exchange_gather: group {group!r} has {pg.size()} ranks, not {world}")
    mine = out[rank * s:(rank + 1) * s]
    if mine.data_ptr() != shard.data_ptr():
        mine.copy_(shard)
    tag = _next_tag(group)
    works = []
    for peer in range(world):
        if peer == rank:
            continue
        works.append(dist.irecv(out[peer * s:(peer + 1) * s], group=pg, group_src=peer, tag=tag))
        works.append(dist.isend(mine, group=pg, group_dst=peer, tag=tag))
    _register(out, works)
    return out


_lib = torch.library.Library("fxspeed", "FRAGMENT")
_lib.define("exchange_scatter(Tensor input, int world, str group) -> Tensor")
_lib.define("exchange_gather(Tensor shard, int world, str group) -> Tensor")
_lib.define("exchange_gather_out(Tensor shard, int world, str group, *, Tensor(a!) out) -> Tensor(a!)")


def _gather_new(shard: Tensor, world: int, group: str) -> Tensor:
    out = torch.empty(world * shard.numel(), dtype=shard.dtype, device=shard.device)
    return _exchange_gather_into(shard, world, group, out)


def _gather_out(shard: Tensor, world: int, group: str, *, out: Tensor) -> Tensor:
    return _exchange_gather_into(shard, world, group, out)


for _key in ("CPU", "CUDA"):
    _lib.impl("exchange_scatter", _exchange_scatter, _key)
    _lib.impl("exchange_gather", _gather_new, _key)
    _lib.impl("exchange_gather_out", _gather_out, _key)


@torch.library.register_fake("fxspeed::exchange_scatter", lib=_lib)
def _(input: Tensor, world: int, group: str) -> Tensor:
    return input.new_empty((world - 1) * (input.numel() // world))


@torch.library.register_fake("fxspeed::exchange_gather", lib=_lib)
def _(shard: Tensor, world: int, group: str) -> Tensor:
    return shard.new_empty(world * shard.numel())


@torch.library.register_fake("fxspeed::exchange_gather_out", lib=_lib)
def _(shard: Tensor, world: int, group: str, *, out: Tensor) -> Tensor:
    return out


exchange_scatter = torch.ops.fxspeed.exchange_scatter.default
exchange_gather = torch.ops.fxspeed.exchange_gather.default
exchange_gather_out = torch.ops.fxspeed.exchange_gather_out.default
EXCHANGE_OPS = (exchange_scatter, exchange_gather, exchange_gather_out)
