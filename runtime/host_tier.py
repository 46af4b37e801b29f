"""The host tier of optimizer and parameter offload on a CUDA device (ZeRO-Offload, ZeRO-
Infinity's CPU tier): model states in host memory, moved over the device's link.

A `DeviceLink` copies between one device's tensors and host tensors:

    to_host(pairs)    device -> host, on a side stream after the work queued so far on the
                      current stream (which made the values); returns an event to `wait` on
                      before the host reads the copies
    to_device(pairs)  host -> device, on the side stream; the current stream waits for it, so
                      whatever is queued later (the next forward) reads the new values

Host tensors it makes (`empty`) are pinned on a CUDA device, so copies are DMA transfers that
run while the host computes. `record_stream` keeps a device source alive until the side stream
has read it (the program frees a bucket's gradient as soon as its step call returns).

The same class drives a CPU "device" (synchronous copies between host tensors, no streams): the
engine does so only when FXSPEED_HOST_TIER_ON_CPU=1 (`host_tier_on_cpu`), a test-only mode that
runs the tier's logic on a machine without a GPU (tests/test_offload_host.py). It moves nothing:
a CPU device's states are in host memory already.
why: docs/decisions/host-offload-tier.md
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import torch

from fxspeed.runtime.offload_io import ALIGN, round_up

ENV_ON_CPU = "FXSPEED_HOST_TIER_ON_CPU"


def host_tier_on_cpu() -> bool:
    """The test-only mode: a CPU device runs the host tier (plain copies) instead of refusing
    offload_device='cpu'."""
    return os.environ.get(ENV_ON_CPU) == "1"


class DeviceLink:
    """Copies between `device`'s tensors and host tensors (see the module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.stats = {"to_host_bytes": 0, "to_device_bytes": 0}

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A host tensor (pinned on a CUDA device) of `numel` elements."""
        return torch.empty(numel, dtype=dtype, pin_memory=self.cuda)

    def aligned(self, nbytes: int) -> "PinnedBuffer":
        """A page-aligned host buffer (pinned on a CUDA device) for O_DIRECT file I/O."""
        return PinnedBuffer(nbytes, self.cuda)

    def to_host(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> Any:
        """Copy each (host dst, device src); returns what `wait` takes (None: done already)."""
        self.stats["to_host_bytes"] += sum(s.numel() * s.element_size() for _, s in pairs)
        if not self.cuda:
            for dst, src in pairs:
                dst.copy_(src)
            return None
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # the values are made there
        with torch.cuda.stream(self.stream):
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
                src.record_stream(self.stream)  # the caller may drop src before the copy has read it
            done = torch.cuda.Event()
            done.record(self.stream)
        return done

    def to_device(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> Any:
        """Copy each (device dst, host src); later work on the current stream sees the values.
        The host sources must stay unchanged until `wait` on the result returns."""
        self.stats["to_device_bytes"] += sum(s.numel() * s.element_size() for _, s in pairs)
        if not self.cuda:
            for dst, src in pairs:
                dst.copy_(src)
            return None
        main = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(main)  # the destination's last readers were queued there
        with torch.cuda.stream(self.stream):
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        main.wait_event(done)
        return done

    def fetch(self, src: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """A new device tensor with `src`'s (host) values, copied on the side stream; hand the
        result's second item to `ready` before the current stream reads the tensor."""
        self.stats["to_device_bytes"] += src.numel() * src.element_size()
        if not self.cuda:
            return src.clone(), None
        # No wait for the current stream: the source is host memory the host wrote synchronously,
        # and the copy of the next bucket should start while this one's gather and compute run.
        with torch.cuda.stream(self.stream):
            out = torch.empty(src.shape, dtype=src.dtype, device=self.device)
            out.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        return out, done

    def ready(self, t: torch.Tensor, event: Any) -> torch.Tensor:
        """`t` (from `fetch`) for the current stream: waits for its copy, and keeps its memory
        from being reused until the current stream is done with it (it was allocated on the
        side stream)."""
        if event is not None:
            main = torch.cuda.current_stream(self.device)
            main.wait_event(event)
            t.record_stream(main)
        return t

    @staticmethod
    def wait(event: Any) -> None:
        """Block the host until the copies behind `event` are done."""
        if event is not None:
            event.synchronize()

    def synchronize(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()


class PinnedBuffer:
    """A page-aligned host buffer (pinned when `pinned`) seen as a flat tensor of `dtype`, with
    the `memoryview` SwapFile reads into and writes from (as offload_io.AlignedBuffer)."""

    def __init__(self, nbytes: int, pinned: bool, dtype: torch.dtype = torch.uint8) -> None:
        self.nbytes = round_up(max(nbytes, 1))
        raw = torch.empty(self.nbytes + ALIGN, dtype=torch.uint8, pin_memory=pinned)
        off = (-raw.data_ptr()) % ALIGN
        self.bytes = raw[off:off + self.nbytes]
        self.tensor = self.bytes.view(dtype)

    def memoryview(self, nbytes: int) -> memoryview:
        return memoryview(self.bytes.numpy())[:round_up(nbytes)]
