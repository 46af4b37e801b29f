"""Activation offload: tensors saved for backward leave the device in forward and come back
ahead of their use in backward.

    forward    x = layer(...)
               fxspeed::offload_activation(x, store, k)   # starts the copy out; x dies at its
               ... (forward's own readers of x)            # last forward reader, not at backward's
    backward   fxspeed::prefetch_activation(store, k0)    # the first reload's copy back, early
               x' = fxspeed::reload_activation(store, k, then=j, ...)   # waits for x, starts j
               ... (backward's readers read x')

Two tiers, one per device type:
- CUDA device: pinned host buffers (one per activation, kept between steps), copies on a side
  stream; `record_stream` keeps a device tensor alive until the copy that reads or writes it is
  done, and backward's stream waits for a reload's copy event.
- CPU device: a `SwapFile` under Config.nvme_path (the host memory is what is being saved):
  the copy into an aligned staging buffer and the write run on the file's I/O threads, so the
  forward thread only submits; a read waits for that activation's write first.

The bytes come back exactly (same dtype, shape and strides: only dense tensors are offloaded),
so a program with offloads computes what it computed without them, bit for bit.

The graph names the store by `store` (PassOptions.activation_store); the engine registers an
`ActivationOffload` under that name (`register`) and sizes it for each compiled program
(`reserve`). passes/memory/offload_activations.py inserts the calls.
why: docs/decisions/activation-offload.md
"""

from __future__ import annotations

import logging
from collections import deque
from concurrent.futures import Future
from typing import Any, Sequence

import torch

from fxspeed.errors import FxspeedError
from fxspeed.runtime.named_stores import NamedStores
from fxspeed.runtime.offload_io import SwapFile, aligned_tensor, round_up

_STORES: "NamedStores[ActivationOffload]" = NamedStores("offloads activations to store")
log = logging.getLogger("fxspeed")
WRITES_IN_FLIGHT = 8  # file tier: activations queued for the disk at once, at most


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """The elements of a dense tensor (any dimension order) in memory order, as a flat view."""
    return t.as_strided((t.numel(),), (1,), t.storage_offset())


class ActivationOffload:
    """Where one engine's offloaded activations live between forward and backward. `root`: the
    directory of the swap file (CPU device); None on a CUDA device (pinned host memory)."""

    def __init__(self, device: torch.device, root: str | None, *, name: str) -> None:
        self.device = device
        self.root = root
        self.name = name
        self.host = device.type == "cuda"
        if not self.host and root is None:
            raise FxspeedError("activation offload on a CPU device keeps activations in files: give Config.nvme_path")
        self.sizes: dict[int, int] = {}             # key -> bytes its region holds
        self.offsets: dict[int, int] = {}
        self.swap: SwapFile | None = None
        self._pinned: dict[int, torch.Tensor] = {}  # CUDA: key -> pinned host buffer (uint8)
        self._writes: dict[int, Any] = {}           # key -> Future (file) or CUDA event
        self._reads: dict[int, tuple[Any, Any]] = {}
        self._layout: dict[int, tuple[tuple[int, ...], tuple[int, ...], torch.dtype, int]] = {}
        self._queued: deque[Future] = deque()  # file writes in submission order
        self._stream = torch.cuda.Stream(device) if self.host else None
        self.stats = {"offloads": 0, "reloads": 0, "waited_reads": 0, "bytes": 0}

    # --- between steps ------------------------------------------------------------------------
    def reserve(self, sizes: dict[int, int]) -> None:
        """Make room for a program's activations (key -> bytes). Regions only grow; the file is
        made again (between steps, nothing in flight) when one must."""
        grown = {k: max(b, self.sizes.get(k, 0)) for k, b in sizes.items()}
        if all(self.sizes.get(k, -1) >= b for k, b in grown.items()) and (self.host or self.swap is not None):
            return
        self.synchronize()
        self.sizes.update(grown)
        if self.host:
            for k, b in grown.items():
                if k not in self._pinned or self._pinned[k].numel() < b:
                    self._pinned[k] = torch.empty(b, dtype=torch.uint8, pin_memory=True)
            return
        at = 0
        for k in sorted(self.sizes):
            self.offsets[k] = at
            at += round_up(self.sizes[k])
        if self.swap is not None:
            self.swap.close()
        self.swap = SwapFile(self.root, at, name=f"{self.name}-activations")

    def synchronize(self) -> None:
        """Every copy out finished and every read dropped (between steps; a failed I/O raises here)."""
        for k in list(self._writes):
            _wait(self._forget_write(k))
        for k in list(self._reads):
            fut, _ = self._reads.pop(k)
            if isinstance(fut, Future):
                fut.result()
        if self._stream is not None:
            self._stream.synchronize()

    def close(self) -> None:
        try:
            self.synchronize()
        finally:
            if self.swap is not None:
                self.swap.close()
            self._pinned.clear()

    # --- in the program -----------------------------------------------------------------------
    def offload(self, key: int, x: torch.Tensor) -> None:
        """Start moving activation `key` out; `x` may be freed by the caller right away."""
        nbytes = x.numel() * x.element_size()
        if nbytes > self.sizes.get(key, -1):
            raise FxspeedError(f"activation offload: activation {key} ({nbytes} bytes) has no room reserved "
                               f"({self.sizes.get(key, 0)} bytes); the engine reserves every compiled program's "
                               "activations before it runs: please report this with the model and Config")
        self._drop_stale(key)
        # What comes back is what left: the live tensor's layout, not the one tracing predicted.
        self._layout[key] = (tuple(x.shape), tuple(x.stride()), x.dtype, nbytes)
        self.stats["offloads"] += 1
        self.stats["bytes"] += nbytes
        src = flat_bytes(x).view(torch.uint8)
        if self.host:
            main = torch.cuda.current_stream(self.device)
            self._stream.wait_stream(main)
            with torch.cuda.stream(self._stream):
                self._pinned[key][:nbytes].copy_(src, non_blocking=True)
                done = torch.cuda.Event()
                done.record(self._stream)
            x.record_stream(self._stream)  # the allocator keeps x until the copy has read it
            self._writes[key] = done
            return
        assert self.swap is not None
        # A disk slower than forward would leave every queued activation alive (and the plan,
        # which counts them gone, wrong): forward waits for the oldest write beyond a few.
        while len(self._queued) >= WRITES_IN_FLIGHT:
            self._queued.popleft().result()
        fut = self.swap.write_copy(self.offsets[key], src, nbytes)
        self._writes[key] = fut
        self._queued.append(fut)

    def prefetch(self, key: int) -> None:
        """Start bringing activation `key` back (a no-op if already started, or for key -1)."""
        if key < 0 or key in self._reads:
            return
        if key not in self._writes:
            raise FxspeedError(f"activation offload: activation {key} is read back before it was offloaded in this "
                               "step; please report this program (compile with Config(disable_passes="
                               "('offload_activations',)) to run without it)")
        nbytes = self._layout[key][3]
        if self.host:
            with torch.cuda.stream(self._stream):
                self._stream.wait_event(self._writes[key])
                back = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
                back.copy_(self._pinned[key][:nbytes], non_blocking=True)
                done = torch.cuda.Event()
                done.record(self._stream)
            self._reads[key] = (done, back)
            return
        write = self._writes[key]
        buf = aligned_tensor(nbytes)
        assert self.swap is not None
        self._reads[key] = (self.swap.read_after(write, self.offsets[key], buf, nbytes), buf)

    def reload(self, key: int, then: int = -1, shape: Sequence[int] | None = None,
               dtype: torch.dtype | None = None) -> torch.Tensor:
        """Activation `key` back (a new tensor with the shape, strides and dtype it left with), and
        activation `then`'s copy back started. `shape`, `dtype`: what the reader expects (checked)."""
        self.stats["reloads"] += 1
        if key not in self._reads:
            self.stats["waited_reads"] += 1  # nothing prefetched it: the copy is on the critical path
            self.prefetch(key)
        fut, buf = self._reads.pop(key)
        self.prefetch(then)
        live_shape, live_stride, live_dtype, nbytes = self._layout[key]
        if shape is not None and live_shape != tuple(shape) or dtype is not None and live_dtype != dtype:
            raise FxspeedError(f"activation offload: activation {key} left as {live_dtype} {list(live_shape)} but the "
                               f"program reads it back as {dtype} {list(shape)}; please report this program (compile "
                               "with Config(disable_passes=('offload_activations',)) to run without it)")
        if self.host:
            main = torch.cuda.current_stream(self.device)
            main.wait_event(fut)
            buf.record_stream(main)  # allocated on the side stream, read by the main one
        else:
            self._forget_write(key)  # read back (or failed): either way this write is over
            fut.result()
        return buf[:nbytes].view(live_dtype).as_strided(live_shape, live_stride)

    def _drop_stale(self, key: int) -> None:
        """Before activation `key` leaves again: the last step's copy of it done, its read dropped.
        A write nothing read back (a step that failed before its reload) may have failed too:
        its data was never needed, so that error is logged, not raised into this step."""
        self._reads.pop(key, None)
        try:
            _wait(self._forget_write(key))
        except Exception as e:  # noqa: BLE001 - see the docstring
            log.warning("fxspeed: an activation write of an earlier, failed step failed too: %s", e)

    def _forget_write(self, key: int) -> Any:
        """Activation `key`'s write, no longer tracked (nor counted in flight)."""
        w = self._writes.pop(key, None)
        if isinstance(w, Future) and w in self._queued:
            self._queued.remove(w)
        return w



def _wait(w: Any) -> None:
    """A write's end: a file write's future (raises its error) or a CUDA copy's event."""
    if isinstance(w, Future):
        w.result()
    elif w is not None:
        w.synchronize()


def register(name: str, store: ActivationOffload) -> None:
    """Make `store` the one programs compiled with PassOptions.activation_store=`name` use."""
    _STORES.register(name, store)


# The three ops are side effects the graph must keep in place (fx's dead-code elimination and
# ours keep impure nodes): registered below with torch.fx.node.has_side_effect.
@torch.library.custom_op("fxspeed::offload_activation", mutates_args=())
def offload_activation(x: torch.Tensor, store: str, key: int) -> None:
    """Start moving `x` (a dense activation saved for backward) out of the device's memory."""
    _STORES.get(store).offload(key, x)


@offload_activation.register_fake
def _offload_activation_fake(x: torch.Tensor, store: str, key: int) -> None:
    return None


@torch.library.custom_op("fxspeed::prefetch_activation", mutates_args=())
def prefetch_activation(store: str, key: int) -> None:
    """Start bringing activation `key` back ahead of its reload."""
    _STORES.get(store).prefetch(key)


@prefetch_activation.register_fake
def _prefetch_activation_fake(store: str, key: int) -> None:
    return None


@torch.library.custom_op("fxspeed::reload_activation", mutates_args=())
def reload_activation(store: str, key: int, then: int, shape: list[int], stride: list[int], dtype: torch.dtype,
                      device: torch.device) -> torch.Tensor:
    """Activation `key` back (waits for its copy), and activation `then`'s copy back started (-1:
    none). `shape`, `stride`, `dtype`, `device`: the activation's, for tracing."""
    return _STORES.get(store).reload(key, then, shape, dtype)  # strides: the live tensor's, as it left


@reload_activation.register_fake
def _reload_activation_fake(store: str, key: int, then: int, shape: list[int], stride: list[int],
                            dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty_strided(shape, stride, dtype=dtype, device=device)


offload_activation_op = torch.ops.fxspeed.offload_activation.default
prefetch_activation_op = torch.ops.fxspeed.prefetch_activation.default
reload_activation_op = torch.ops.fxspeed.reload_activation.default
for _op in (offload_activation_op, prefetch_activation_op, reload_activation_op):
    torch.fx.node.has_side_effect(_op)
