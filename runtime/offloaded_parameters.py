"""Parameter offload (ZeRO-Infinity's parameter tier): this rank's low-precision working shards
of every ZeRO-3 bucket live in a swap file, not in memory, and the program reads each one back
just ahead of its gather.

    between steps   file: [shard 0 | shard 1 | ...] (page-aligned regions, working precision)
                    memory: nothing (the FlatParameters' working-shard tensors keep their shape
                    but their storage is resized to 0 bytes: reading one raises or faults,
                    never returns stale values)
    in the program  w0 = fxspeed::fetch_shard(store, 0, then=1)   # waits for bucket 0's read,
                    a0 = exchange_gather(w0, N, g) ...             # starts bucket 1's
    after the step  the new working shards (the masters rounded) are written back, bucket by
                    bucket, as the optimizer finishes each (at most two writes in flight)

A fetch returns a fresh page-aligned buffer (so the gather may still be sending it while the
next read fills another), dropped once the gather is done with it: memory holds the shards of
the two or three buckets around the one being computed, as ZeRO-3 holds their gathers.

On a CUDA device (a `link`, runtime/host_tier.py) the shards live in pinned host tensors
(offload_device="cpu") or in the file through pinned buffers ("nvme"), and a fetch returns a
device tensor: from host memory the next bucket's copy runs on a side stream while this one is
gathered; after a step the optimizer writes the new working values into the host shards in
place (no copy back to the device).

The graph names the files by `store` (PassOptions.parameter_store); the engine registers its
`ParameterFiles` under that name (`register`). passes/memory/offload_parameters.py inserts the
fetches. why: docs/decisions/parameter-offload.md
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any, Sequence

import torch

from fxspeed.errors import FxspeedError
from fxspeed.runtime.named_stores import NamedStores
from fxspeed.runtime.host_tier import DeviceLink, PinnedBuffer
from fxspeed.runtime.offload_io import AlignedBuffer, SwapFile, round_up

_STORES: "NamedStores[ParameterFiles]" = NamedStores("reads offloaded parameters from store")
WRITES_IN_FLIGHT = 2


class ParameterFiles:
    """The working shards `shards` (one flat tensor per bucket, all one dtype) kept in a file under
    `root`. After `offload()` their storages are empty; `write(k, values)` sets bucket k's shard,
    `fetch(k)` reads it back (a new tensor).

    With a `link` (the host tier, runtime/host_tier.py) the shards live on `link.device` and a
    fetch copies the shard to that device (read ahead: the copy of the next bucket runs on the
    link's side stream while this one is gathered): from a pinned host tensor per shard when
    `root` is None (offload_device="cpu"), else from the file through pinned buffers."""

    def __init__(self, shards: Sequence[torch.Tensor], root: str | None, *, name: str,
                 link: DeviceLink | None = None) -> None:
        self.shards = list(shards)
        self.dtype = self.shards[0].dtype if self.shards else torch.bfloat16
        self.link = link
        where = link.device.type if link is not None else "cpu"
        for k, t in enumerate(self.shards):
            if t.dim() != 1 or not t.is_contiguous() or t.dtype != self.dtype or t.device.type != where:
                raise FxspeedError(f"parameter offload keeps flat {self.dtype} shards of the {where} device; shard {k} "
                                   f"is {t.dtype} {tuple(t.shape)} on {t.device}")
        if root is None and link is None:
            raise FxspeedError("parameter offload keeps the working shards in files (root) or, on a device, in host "
                               "memory (link); it was given neither")
        self.offsets, total = [], 0
        for t in self.shards:
            self.offsets.append(total)
            total += round_up(t.numel() * t.element_size())
        # the host tier: one pinned host tensor per shard, no file
        self.host = [link.empty(t.numel(), self.dtype) for t in self.shards] if root is None and link else None
        self.swap = SwapFile(root, total, name=f"{name}-params") if root is not None else None
        # bucket -> (the file read's future and its buffer), or (the copy's event, the device tensor)
        self._reads: dict[int, tuple[Any, Any]] = {}
        self._writes: dict[int, Future] = {}        # bucket -> write in flight
        self._staging: dict[int, tuple[AlignedBuffer, int]] = {}  # bucket -> (buffer, elements filled)
        self._index = {id(t): k for k, t in enumerate(self.shards)}
        self.stats = {"bytes": total, "fetches": 0, "waited_reads": 0,
                      "direct_io": self.swap is not None and self.swap.direct,
                      "host_bytes": sum(h.numel() * h.element_size() for h in self.host or ())}

    # --- between steps ----------------------------------------------------------------------
    def offload(self, write: bool = True) -> None:
        """Write every shard's current values to the file (`write`; else the caller writes them
        before the first fetch) and free their memory."""
        for k, t in enumerate(self.shards):
            if write:
                self.write(k, t)
        self.synchronize()
        for t in self.shards:
            t.untyped_storage().resize_(0)

    def write(self, k: int, values: torch.Tensor) -> None:
        """Bucket k's shard := `values` (rounded to the working dtype), written asynchronously."""
        if self.host is not None:  # host tier: into the pinned shard (a device source: a copy that waits)
            self._drop_read(k)
            self.host[k].copy_(values.reshape(-1))
            return
        buf = self._buffer(k)
        buf.tensor[:self.shards[k].numel()].copy_(values.reshape(-1))
        self._submit(k, buf)

    def _buffer(self, k: int) -> AlignedBuffer | PinnedBuffer:
        """A page-aligned buffer for bucket k's shard (pinned when the link reaches a CUDA device)."""
        if self.link is not None:
            return PinnedBuffer(self._nbytes(k), self.link.cuda, self.dtype)
        return AlignedBuffer(self._nbytes(k), self.dtype)

    def _drop_read(self, k: int) -> None:
        """Forget bucket k's read ahead (its values are about to change); a copy still reading the
        host shard is waited for first."""
        r = self._reads.pop(k, None)
        if r is None:
            return
        if isinstance(r[0], Future):
            r[0].result()
        elif self.link is not None:
            self.link.wait(r[0])

    def write_piece(self, shard: torch.Tensor, start: int, values: torch.Tensor) -> None:
        """Elements [start, start + values.numel()) of the shard `shard` (one of `shards`): staged
        until the whole shard is written, then written to the file (the offloaded optimizer hands
        a shard over one chunk-sized run at a time). The host tier writes them in place."""
        k = self._index[id(shard)]
        if self.host is not None:
            self._drop_read(k)
            self.host[k][start:start + values.numel()].copy_(values.reshape(-1))
            return
        buf, filled = self._staging.get(k) or (self._buffer(k), 0)
        n = values.numel()
        buf.tensor[start:start + n].copy_(values.reshape(-1))
        filled += n
        if filled < shard.numel():
            self._staging[k] = (buf, filled)
            return
        self._staging.pop(k, None)
        self._submit(k, buf)

    def _submit(self, k: int, buf: AlignedBuffer) -> None:
        self._finish_write(k)
        while len(self._writes) >= WRITES_IN_FLIGHT:  # bound the staging buffers alive at once
            self._finish_write(next(iter(self._writes)))
        self._reads.pop(k, None)  # a read started before this write would bring back old values
        fut = self.swap.write(self.offsets[k], buf, self._nbytes(k))
        fut.buffer = buf  # type: ignore[attr-defined]  # alive until written
        self._writes[k] = fut

    def _finish_write(self, k: int) -> None:
        w = self._writes.pop(k, None)
        if w is not None:
            w.result()

    def synchronize(self) -> None:
        """Every write on disk. A shard staged piece by piece and not completed is an error: its
        file region would hold a mix of two steps."""
        if self._staging:
            k = next(iter(self._staging))
            self._staging.clear()
            raise FxspeedError(f"parameter offload: the working shard of bucket {k} was written only in part; please "
                               "report this with the model and Config")
        for k in list(self._writes):
            self._finish_write(k)

    # --- in the program -----------------------------------------------------------------------
    def prefetch(self, k: int) -> None:
        """Start reading bucket k's shard (a no-op if its read is in flight)."""
        if k in self._reads or not 0 <= k < len(self.shards):
            return
        if self.host is not None:  # host tier: the copy to the device, on the link's side stream
            self._reads[k] = self.link.fetch(self.host[k])[::-1]
            return
        self._finish_write(k)
        buf = self._buffer(k)
        self._reads[k] = (self.swap.read(self.offsets[k], buf, self._nbytes(k)), buf)

    def fetch(self, k: int, then: int = -1) -> torch.Tensor:
        """Bucket k's shard (a new tensor on the shards' device), and the read of bucket `then`
        started."""
        self.stats["fetches"] += 1
        if k not in self._reads:
            self.stats["waited_reads"] += 1  # nothing prefetched it: a read on the critical path
            self.prefetch(k)
        fut, buf = self._reads.pop(k)
        self.prefetch(then)
        if self.host is not None:
            return self.link.ready(buf, fut)
        fut.result()
        values = buf.tensor[:self.shards[k].numel()]
        if self.link is None:
            return values
        # files on a device: read into pinned memory, then copied over (the buffer lives on until
        # the copy is done: the pinned allocator records its use by the copy)
        return self.link.ready(*self.link.fetch(values))

    def _nbytes(self, k: int) -> int:
        return self.shards[k].numel() * self.dtype.itemsize

    def close(self) -> None:
        self._staging.clear()
        for k in list(self._writes):
            self._finish_write(k)
        for k in list(self._reads):
            self._drop_read(k)
        if self.swap is not None:
            self.swap.close()


def register(name: str, files: ParameterFiles) -> None:
    """Make `files` the store the programs compiled with PassOptions.parameter_store=`name` read."""
    _STORES.register(name, files)


@torch.library.custom_op("fxspeed::fetch_shard", mutates_args=())
def fetch_shard(store: str, bucket: int, then: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Bucket `bucket`'s working shard from the parameter files `store` (waits for its read), and
    the read of bucket `then` started (-1: none). `numel`, `dtype`: the shard's, for tracing."""
    return _STORES.get(store).fetch(bucket, then)


@fetch_shard.register_fake
def _fetch_shard_fake(store: str, bucket: int, then: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(numel, dtype=dtype)


fetch_shard_op = torch.ops.fxspeed.fetch_shard.default
