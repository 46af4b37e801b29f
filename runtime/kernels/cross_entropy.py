"""Cross-entropy over a vocabulary projection, in chunks of rows, gradients included.

    fxspeed::linear_cross_entropy(h [N, C], wt [C, V], target [N], ignore_index, reduction, chunk_rows)
        -> (loss [], grad_h [N, C], grad_wt_t [V, C])

loss is `nll_loss(log_softmax(h @ wt), target, ignore_index, reduction)` (reduction 1: mean over
the rows whose target is not ignore_index, 2: sum); grad_h and grad_wt_t are its gradients for a
unit upstream gradient: d loss / d h, and (d loss / d wt)^T, i.e. what `dlogits @ wt^T` and
`dlogits^T @ h` give in the backward of the unfused graph. The caller multiplies them by the real
upstream gradient (a scalar), so the gradients are computed here, in forward, one chunk of rows at
a time: the [N, V] logits, log-probabilities and their gradient never exist, only a [chunk_rows, V]
block (the trick of Liger's fused linear cross-entropy; the code is ours).

Numerics: the matmuls run in the inputs' dtype (bf16 under mixed precision, as the unfused graph's
casts make them; on a CPU without native bf16/fp16 arithmetic in fp32 from the same values, rounded
once, as upcast_cpu_compute makes the unfused graph's), the softmax in fp32, the weight gradient accumulates over chunks in fp32 and is
rounded once.

Memory: besides its outputs the op holds one chunk's blocks and, under bf16/fp16, the weight
gradient's fp32 sum [V, C] (plus the weight in fp32 where the CPU upcasts); `workspace_bytes`
declares that to the planner (fxspeed.ir.register_workspace), which counts it while the op runs. `passes/memory/chunk_cross_entropy.py` puts this op into graphs.

The softmax part of a chunk (`chunk_loss_and_grad`: each row's loss and its logits' gradient d from
the chunk's logits) has two implementations:

- a Triton kernel, when the logits are on CUDA (or on the CPU under Triton's interpreter,
  TRITON_INTERPRET=1, what the tests check): one program per row, two passes over it in BLOCK_V
  slices (an online max / sum of exponentials, then d = (exp(x - lse) - onehot) * multiplier, cast
  to h's dtype and written over the logits where the dtypes match). It reads 16-bit logits as they
  come from the matmul and computes in fp32, so there is no fp32 copy of the block; the torch path
  makes about six passes over the [chunk, V] fp32 block.
- the torch implementation (CPU, and whatever the kernel does not take), the reference.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.utils.flop_counter import register_flop_formula

from fxspeed.devices import cpu_computes_natively
from fxspeed.ir import register_workspace

from .launch import interpreting, use_triton

Tensor = torch.Tensor

BLOCK_V = 4096  # the kernel's slice of a row (elements); a row of any length loops over slices


def _upcasts(h: Tensor) -> bool:
    """Whether the matmuls run in fp32 from h's values: a bf16/fp16 h on a CPU without native
    arithmetic for it, as passes/graph/upcast_cpu_compute.py does in graphs (PyTorch's reference
    GEMM there is 5-100x slower than fp32; the copies cost far less than the products)."""
    return h.device.type == "cpu" and not cpu_computes_natively(h.dtype)  # True for fp32 and other dtypes


SLICE_BYTES = 32 * 2**20  # the weight gradient's product is added in vocabulary slices of about this


@torch.library.custom_op("fxspeed::linear_cross_entropy", mutates_args=())
def linear_cross_entropy(h: Tensor, wt: Tensor, target: Tensor, ignore_index: int, reduction: int,
                         chunk_rows: int) -> tuple[Tensor, Tensor, Tensor]:
    n = h.shape[0]
    valid = target != ignore_index
    count = valid.sum().to(torch.float32)
    scale = 1.0 / count if reduction == 1 else torch.ones((), dtype=torch.float32, device=h.device)
    loss = torch.zeros((), dtype=torch.float32, device=h.device)
    grad_h = torch.empty_like(h)
    grad_wt_t = torch.zeros(wt.shape[1], wt.shape[0], dtype=torch.float32, device=h.device)
    upcast = _upcasts(h)
    w = wt.float() if upcast else wt  # made once, not per chunk
    for start in range(0, n, max(1, chunk_rows)):
        stop = min(n, start + chunk_rows)
        hc = h[start:stop]
        hx = hc.float() if upcast else hc
        ok = valid[start:stop]
        # logits rounded to h's dtype, as the unfused graph's matmul output (passed without a
        # name: chunk_loss_and_grad frees them once it has their fp32 copy)
        row_loss, d = chunk_loss_and_grad((hx @ w).to(h.dtype), target[start:stop], ok, scale, h.dtype)
        loss += row_loss.sum()
        dx = d.float() if upcast else d
        grad_h[start:stop] = dx @ w.t()  # rounded to h's dtype by the copy
        if dx.dtype == torch.float32:
            grad_wt_t.addmm_(dx.t(), hx)
        else:  # the product in the compute dtype (as the unfused backward's matmul), summed in fp32,
            # a slice of the vocabulary at a time: never a whole [V, C] product beside the sum
            step = max(1, SLICE_BYTES // max(1, hc.shape[1] * hc.element_size()))
            for v in range(0, grad_wt_t.shape[0], step):
                grad_wt_t[v:v + step].add_(d[:, v:v + step].t() @ hc)
        del d, dx
    del w
    if reduction == 1:
        loss = loss / count
    return loss, grad_h, grad_wt_t.to(h.dtype)


def workspace_bytes(h: Tensor, wt: Tensor, target: Tensor, ignore_index: int, reduction: int,
                    chunk_rows: int) -> int:
    """What `linear_cross_entropy` holds inside itself beyond its outputs, at most: one chunk's fp32
    logits and logsumexp's block of the same size; under bf16/fp16 the fp32 sum of the weight
    gradient [V, C] as well, and the weight in fp32 where the CPU upcasts. (Measured at 512 x 512
    x 50257 by peak RSS, MiB: fp32 63 vs 64 declared, bf16 160 vs 162, bf16 upcast 210 vs 260.)"""
    n, c = h.shape
    v = wt.shape[1]
    chunk = min(n, max(1, chunk_rows)) * v * 8
    if h.dtype == torch.float32:  # the fp32 sum is the output itself
        return chunk
    return chunk + v * c * 4 * (2 if _upcasts(h) else 1)


register_workspace(torch.ops.fxspeed.linear_cross_entropy.default, workspace_bytes)


def chunk_loss_and_grad(logits: Tensor, target: Tensor, ok: Tensor, scale: Tensor,
                        dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """One chunk's softmax part: (loss of each row [M] fp32, 0 where not `ok`; d [M, V] in `dtype`,
    the gradient of `scale * sum(loss)` with respect to the logits, 0 on rows not `ok`), from the
    chunk's logits [M, V] (the matmul's output, in its dtype; overwritten). The Triton kernel where
    `kernel_applies` says so, else the torch implementation."""
    mult = torch.where(ok, scale, 0.0)  # ignored rows: no gradient (even if all are: scale is inf then)
    if kernel_applies(logits):
        return _chunk_triton(logits, torch.where(ok, target, 0), ok, mult, dtype)
    logits = logits.float()
    lse = torch.logsumexp(logits, dim=1)
    tgt = torch.where(ok, target, 0)
    picked = logits.gather(1, tgt[:, None]).squeeze(1)
    row_loss = torch.where(ok, lse - picked, 0.0)
    probs = logits.sub_(lse[:, None]).exp_()  # softmax, in the logits' storage
    probs[torch.arange(logits.shape[0], device=logits.device), tgt] -= 1.0
    probs.mul_(mult[:, None])
    return row_loss, probs.to(dtype)


# --- the Triton kernel ------------------------------------------------------------------------

def kernel_applies(logits: Tensor) -> bool:
    """Whether a chunk goes to the Triton kernel: logits on CUDA (or the CPU under TRITON_INTERPRET=1),
    fp32/bf16/fp16, a non-empty [M, V] block whose rows are contiguous."""
    if logits.dim() != 2 or logits.numel() == 0 or logits.stride(1) != 1:
        return False
    return use_triton(logits)


def _kernel() -> Any:
    """The Triton kernel (imports triton on first use). Triton decides at decoration time whether a
    kernel is interpreted, so it is made once per TRITON_INTERPRET setting."""
    return _make_kernel(interpreting())


@functools.cache
def _make_kernel(interpret: bool) -> Any:
    import triton
    import triton.language as tl

    # everything the kernel calls is inline: Triton's interpreter re-executes a kernel's source
    # against its module's globals and cannot see a closure (NameError)

    @triton.jit
    def cross_entropy_rows(X, Tgt, Ok, Mult, Loss, D, V, stride_x, stride_d,
                           BLOCK_V: tl.constexpr, ROUND_BF16: tl.constexpr):
        # one program: one row. Pass 1: lse = log(sum(exp(x))) by an online max / sum over slices;
        # pass 2: d = (exp(x - lse) - onehot(target)) * mult, the torch path's operations in its order
        row = tl.program_id(0).to(tl.int64)
        x_row = X + row * stride_x
        d_row = D + row * stride_d
        cols = tl.arange(0, BLOCK_V)
        tgt = tl.load(Tgt + row)  # 0 on ignored rows (as the torch path's gather / one-hot)
        ok = tl.load(Ok + row) != 0
        mult = tl.load(Mult + row)
        m = float("-inf")
        s = 0.0
        for start in range(0, V, BLOCK_V):
            mask = start + cols < V
            x = tl.load(x_row + start + cols, mask=mask, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(x, axis=0))  # finite: a slice holds at least one column
            s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
            m = m_new
        lse = tl.log(s) + m
        in_range = (tgt >= 0) & (tgt < V)  # an out-of-range target reads nothing (torch's gather raises)
        picked = tl.load(x_row + tgt, mask=in_range, other=0.0).to(tl.float32)
        tl.store(Loss + row, tl.where(ok, lse - picked, 0.0))
        for start in range(0, V, BLOCK_V):
            c = start + cols
            mask = c < V
            x = tl.load(x_row + c, mask=mask, other=0.0).to(tl.float32)
            p = tl.exp(x - lse)
            d = tl.where(c == tgt, p - 1.0, p) * mult
            if ROUND_BF16:  # the interpreter's fp32 -> bf16 conversion truncates: round to nearest even
                b = d.to(tl.uint32, bitcast=True)
                d = ((b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
            tl.store(d_row + c, d.to(D.dtype.element_ty), mask=mask)

    return cross_entropy_rows


def _chunk_triton(logits: Tensor, tgt: Tensor, ok: Tensor, mult: Tensor,
                  dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """`chunk_loss_and_grad` through the kernel; tgt is 0 on the rows not `ok`. d goes into the
    logits' storage when it has their dtype."""
    M, V = logits.shape
    d = logits if logits.dtype == dtype else torch.empty(M, V, dtype=dtype, device=logits.device)
    row_loss = torch.empty(M, dtype=torch.float32, device=logits.device)
    block = min(BLOCK_V, max(16, 1 << (V - 1).bit_length()))
    _kernel()[(M,)](logits, tgt.contiguous(), ok.contiguous(), mult.to(torch.float32).contiguous(), row_loss, d,
                    V, logits.stride(0), d.stride(0), BLOCK_V=block,
                    ROUND_BF16=interpreting() and dtype == torch.bfloat16, num_warps=min(8, max(1, block // 256)))
    return row_loss, d


@linear_cross_entropy.register_fake
def _(h: Tensor, wt: Tensor, target: Tensor, ignore_index: int, reduction: int,
      chunk_rows: int) -> tuple[Tensor, Tensor, Tensor]:
    return (h.new_empty((), dtype=torch.float32), torch.empty_like(h),
            h.new_empty((wt.shape[1], wt.shape[0])))


@register_flop_formula(torch.ops.fxspeed.linear_cross_entropy)
def _flops(h_shape, wt_shape, *args, **kwargs) -> int:  # noqa: ANN001, ANN002, ANN003 - torch's formula signature
    n, c = h_shape
    return 3 * 2 * n * c * wt_shape[1]  # the logits, and the two gradient products


def rows_per_chunk(vocab: int, chunk_bytes: int = 32 * 2**20) -> int:
    """Rows whose fp32 logits fill about `chunk_bytes`."""
    return max(16, chunk_bytes // max(1, 4 * vocab))
