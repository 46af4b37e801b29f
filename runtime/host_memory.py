"""Host memory housekeeping for the CPU runtime.

glibc keeps large freed blocks in its heap once its mmap threshold has grown after large frees,
so a process that drops gigabytes of weights (tp slicing, master weights moved to the offload
file, the module's fp32 Parameters released into flat buckets) stays that large unless the heap
is trimmed.
"""

from __future__ import annotations

import functools
from typing import Any


def release_freed_host_memory() -> None:
    """Give freed heap pages back to the OS (glibc's malloc_trim). The full weights a rank just
    cut to slices were freed into the C heap, where glibc keeps them (its mmap threshold grows
    after large frees, so weight-sized blocks come from the heap): without this a tp rank on
    the CPU stays as large as the whole model. A no-op where there is no glibc."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.lru_cache(maxsize=1)
def _malloc_trim() -> Any:
    """libc's malloc_trim, looked up once (find_library runs ldconfig), or None."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None
    except OSError:
        return None
