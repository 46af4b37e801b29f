"""How fxspeed's Triton kernels are dispatched and launched, shared by every kernel module here
(norms, residual_norms, rotary, activations, paged_attention): whether a call goes to Triton at
all (CUDA tensors, or CPU tensors under the interpreter, TRITON_INTERPRET=1), and the block,
program and warp counts of a row-wise kernel. Nothing here imports triton except
`triton_available`, on the way to a launch.
"""

from __future__ import annotations

import functools
import math
import os
from typing import Optional, Sequence

import torch

Tensor = torch.Tensor

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_BLOCK = 65536  # wider rows (elements) fall back to torch: one row must fit one program


@functools.cache
def triton_available() -> bool:
    """Whether triton imports (called only on the way to a kernel launch)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "") == "1"


def use_triton(*tensors: Optional[Tensor]) -> bool:
    """True when these tensors go to the Triton kernels (CUDA, or the interpreter on CPU)."""
    ts = [t for t in tensors if t is not None]
    x = ts[0]
    if not (x.is_cuda or (interpreting() and x.device.type == "cpu")):
        return False
    if any(t.dtype not in KERNEL_DTYPES or t.device != x.device for t in ts):
        return False
    return triton_available()


def rows_of(x: Tensor, normalized_shape: Sequence[int]) -> tuple[int, int]:
    n = math.prod(normalized_shape)
    return (x.numel() // n if n else 0), n


def stat_shape(x: Tensor, normalized_shape: Sequence[int]) -> list[int]:
    axis = x.dim() - len(normalized_shape)
    return [*x.shape[:axis], *([1] * len(normalized_shape))]


def block_for(n: int) -> int:
    return max(16, 1 << (max(n, 1) - 1).bit_length())


def reduce_programs(x: Tensor, m: int) -> int:
    if x.is_cuda:
        return max(1, min(m, 4 * torch.cuda.get_device_properties(x.device).multi_processor_count))
    return max(1, min(m, 8))


def warps_for(block: int) -> int:
    return min(16, max(1, block // 256))


def flat_or(t: Optional[Tensor], dummy: Tensor) -> Tensor:
    """A weight/bias as the kernels read it (contiguous), or a dummy pointer when absent."""
    return t.contiguous() if t is not None else dummy


def empty_like_missing(x: Tensor) -> Tensor:
    return x.new_empty((0,))
