"""Host memory housekeeping for the CPU runtime.

glibc keeps large freed blocks in its heap once its mmap threshold has grown after large frees,
so a process that drops gigabytes of weights (tp slicing, master weights moved to the offload
file, the module's fp32 Parameters released into flat buckets) stays that large unless the heap
is trimmed.

Not done here: fixing glibc's mmap threshold for the whole process (mallopt, or the user's
MALLOC_MMAP_THRESHOLD_, which the benchmarks set so RSS follows live tensors). Measured on the
tp benchmark's GPT (109M, TP=2, one thread a rank): 1 MiB fixed lowered the peak RSS growth by
120-200 MB but cost 14% more CPU per step (page faults on every step's fresh blocks); a user
who wants the memory can set the variable.
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
