"""LayerNorm and RMSNorm, forward and backward, as Triton kernels wrapped in torch custom ops.

`passes/graph/fuse_kernels.py` puts these ops into graphs in place of ATen's:

    fxspeed::layer_norm_fwd(x, normalized_shape, weight?, bias?, eps, out_dtype?) -> (out, mean, rstd)
        what aten.native_layer_norm returns (same shapes and dtypes; out in out_dtype when given)
    fxspeed::layer_norm_bwd(grad_out, x, normalized_shape, mean, rstd, weight?, bias?)
        -> (grad_input, grad_weight, grad_bias)       aten.native_layer_norm_backward with
                                                       output_mask [True, weight?, bias?]; the
                                                       gradient of an absent weight/bias is an
                                                       empty tensor
    fxspeed::rms_norm_fwd(x, normalized_shape, weight?, eps?, out_dtype?) -> (out, rstd)
        aten._fused_rms_norm (what F.rms_norm / nn.RMSNorm dispatch to on CUDA; out in out_dtype
        when given)
    fxspeed::rms_norm_bwd(grad_out, x, normalized_shape, rstd, weight?) -> (grad_input, grad_weight)
        aten._fused_rms_norm_backward with output_mask [True, weight?]

out_dtype (None: the input's dtype, as ATen's ops) is a cast folded into the norm
(passes/graph/fold_norm_casts.py): the op returns exactly `out.to(out_dtype)` of the op without
it, and the statistics unchanged. For fp32 inputs (what bf16/fp16 programs normalize) the kernel
writes out in out_dtype directly, rounded once from its fp32 value to nearest even, what torch's
`.to` does (Triton's interpreter truncates fp32 -> bf16 conversions, so under it the kernel
rounds by hand); otherwise, and in the fallback, out is converted after. `out_dtypes` below.

Kernels: one row (the normalized trailing dims, flattened) per program for the forward and the
input gradient, fp32 accumulation whatever the input dtype (fp32, bf16, fp16). The weight and
bias gradients are reduced over rows without atomics: each of G programs walks rows
pid, pid + G, ... and writes its fp32 partial sums, which torch adds (deterministic).

Implementation used: the Triton kernel when the tensor is on CUDA, or when TRITON_INTERPRET=1
(Triton's interpreter, on CPU tensors: what the tests check; it must be set before triton is
first imported, and torch imports triton with AOT autograd); otherwise a pure-torch fallback
(the ATen op itself, or its formula where ATen has no CPU kernel). Triton is imported lazily,
on the first kernel launch, never when fxspeed is imported; without Triton the fallback runs.
Each op has a fake implementation (FakeTensor tracing, the rewrite helpers, the planner) that
gives exactly ATen's output metadata.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Optional, Sequence

import torch

from .launch import (KERNEL_DTYPES, MAX_BLOCK, block_for, empty_like_missing, flat_or, interpreting, reduce_programs,
                     rows_of, stat_shape, triton_available, use_triton, warps_for)

Tensor = torch.Tensor
aten = torch.ops.aten


def _ln_stat_dtype(x: Tensor) -> torch.dtype:
    # native_layer_norm's mean/rstd: the input's dtype on CPU, fp32 (the accumulation type) on CUDA
    return x.dtype if x.device.type == "cpu" else torch.float32


def as_dtype(t: Tensor, dtype: Optional[torch.dtype]) -> Tensor:
    """t converted to `dtype` (None: as it is); t itself when it has that dtype (a fresh output)."""
    return t if dtype is None or t.dtype == dtype else t.to(dtype)


def out_dtypes(computed: torch.dtype, out_dtype: Optional[torch.dtype]) -> tuple[torch.dtype, bool]:
    """(the dtype a kernel stores the normalized output in, whether that is out_dtype already):
    out_dtype itself when the output is computed as fp32 (one rounding, what `y.to(out_dtype)`
    gives), else the computed dtype, converted after (as the op without out_dtype, then `.to`)."""
    if out_dtype is None or out_dtype == computed:
        return computed, True
    if computed == torch.float32 and out_dtype in KERNEL_DTYPES:
        return out_dtype, True
    return computed, False


def round_bf16(y: Tensor) -> bool:
    """ROUND_BF16, the kernels' flag: y (fp32 in the kernel) is stored as bf16 under Triton's
    interpreter, whose fp32 -> bf16 conversion truncates; the kernel rounds to nearest even first."""
    return interpreting() and y.dtype == torch.bfloat16


def _kernels() -> Any:
    """The Triton kernels (imports triton on first use). Triton decides at decoration time
    whether a kernel is interpreted, so they are made once per TRITON_INTERPRET setting."""
    return _make_kernels(interpreting())


@functools.cache
def _make_kernels(interpret: bool) -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def ln_fwd(X, W, B, Y, Mean, Rstd, N, eps, HAS_W: tl.constexpr, HAS_B: tl.constexpr, BLOCK: tl.constexpr,
               ROUND_BF16: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < N
        x = tl.load(X + row * N + cols, mask=mask, other=0.0).to(tl.float32)
        mean = tl.sum(x, axis=0) / N
        xc = tl.where(mask, x - mean, 0.0)
        var = tl.sum(xc * xc, axis=0) / N
        rstd = 1.0 / tl.sqrt(var + eps)
        y = xc * rstd
        if HAS_W:
            y = y * tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_B:
            y = y + tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
        if ROUND_BF16:  # to nearest even, by hand (the interpreter's conversion truncates); then exact
            b = y.to(tl.uint32, bitcast=True)
            y = ((b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
        tl.store(Y + row * N + cols, y.to(Y.dtype.element_ty), mask=mask)
        tl.store(Mean + row, mean.to(Mean.dtype.element_ty))
        tl.store(Rstd + row, rstd.to(Rstd.dtype.element_ty))

    @triton.jit
    def ln_bwd(DY, X, W, Mean, Rstd, DX, DWp, DBp, M, N, G, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
               BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < N
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32) if HAS_W else tl.where(mask, 1.0, 0.0)
        dw = tl.zeros([BLOCK], dtype=tl.float32)
        db = tl.zeros([BLOCK], dtype=tl.float32)
        for row in range(pid, M, G):
            off = tl.cast(row, tl.int64) * N
            x = tl.load(X + off + cols, mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(DY + off + cols, mask=mask, other=0.0).to(tl.float32)
            mean = tl.load(Mean + row).to(tl.float32)
            rstd = tl.load(Rstd + row).to(tl.float32)
            xhat = tl.where(mask, (x - mean) * rstd, 0.0)
            wdy = w * dy
            c1 = tl.sum(xhat * wdy, axis=0) / N
            c2 = tl.sum(wdy, axis=0) / N
            dx = (wdy - (xhat * c1 + c2)) * rstd
            tl.store(DX + off + cols, dx.to(DX.dtype.element_ty), mask=mask)
            dw += dy * xhat
            db += dy
        if HAS_W:
            tl.store(DWp + pid * N + cols, dw, mask=mask)
        if HAS_B:
            tl.store(DBp + pid * N + cols, db, mask=mask)

    @triton.jit
    def rms_fwd(X, W, Y, Rstd, N, eps, HAS_W: tl.constexpr, BLOCK: tl.constexpr, ROUND_BF16: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < N
        x = tl.load(X + row * N + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / N + eps)
        y = x * rstd
        if HAS_W:
            y = y * tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        if ROUND_BF16:
            b = y.to(tl.uint32, bitcast=True)
            y = ((b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
        tl.store(Y + row * N + cols, y.to(Y.dtype.element_ty), mask=mask)
        tl.store(Rstd + row, rstd)

    @triton.jit
    def rms_bwd(DY, X, W, Rstd, DX, DWp, M, N, G, HAS_W: tl.constexpr, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < N
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32) if HAS_W else tl.where(mask, 1.0, 0.0)
        dw = tl.zeros([BLOCK], dtype=tl.float32)
        for row in range(pid, M, G):
            off = tl.cast(row, tl.int64) * N
            x = tl.load(X + off + cols, mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(DY + off + cols, mask=mask, other=0.0).to(tl.float32)
            rstd = tl.load(Rstd + row).to(tl.float32)
            xhat = x * rstd
            wdy = w * dy
            c1 = tl.sum(xhat * wdy, axis=0) / N
            dx = (wdy - xhat * c1) * rstd
            tl.store(DX + off + cols, dx.to(DX.dtype.element_ty), mask=mask)
            dw += dy * xhat
        if HAS_W:
            tl.store(DWp + pid * N + cols, dw, mask=mask)

    return ln_fwd, ln_bwd, rms_fwd, rms_bwd


# --- LayerNorm ---------------------------------------------------------------------------------

@torch.library.custom_op("fxspeed::layer_norm_fwd", mutates_args=())
def layer_norm_fwd(x: Tensor, normalized_shape: list[int], weight: Optional[Tensor], bias: Optional[Tensor],
                   eps: float, out_dtype: Optional[torch.dtype] = None) -> tuple[Tensor, Tensor, Tensor]:
    m, n = rows_of(x, normalized_shape)
    if not use_triton(x, weight, bias) or m == 0 or n == 0 or block_for(n) > MAX_BLOCK:
        out, mean, rstd = aten.native_layer_norm.default(x, normalized_shape, weight, bias, eps)
        return as_dtype(out, out_dtype), mean, rstd
    ln_fwd = _kernels()[0]
    xc = x.contiguous()
    y = torch.empty_like(xc, dtype=out_dtypes(x.dtype, out_dtype)[0])
    sd = _ln_stat_dtype(x)
    mean = torch.empty(m, device=x.device, dtype=sd)
    rstd = torch.empty(m, device=x.device, dtype=sd)
    block = block_for(n)
    ln_fwd[(m,)](xc, flat_or(weight, xc), flat_or(bias, xc), y, mean, rstd, n,
                 float(eps), HAS_W=weight is not None, HAS_B=bias is not None, BLOCK=block,
                 ROUND_BF16=round_bf16(y), num_warps=warps_for(block))
    shape = stat_shape(x, normalized_shape)
    return as_dtype(y.view(x.shape), out_dtype), mean.view(shape), rstd.view(shape)


@layer_norm_fwd.register_fake
def _(x, normalized_shape, weight, bias, eps, out_dtype=None):
    out, mean, rstd = aten.native_layer_norm.default(x, normalized_shape, weight, bias, eps)
    return as_dtype(out, out_dtype), mean, rstd


@torch.library.custom_op("fxspeed::layer_norm_bwd", mutates_args=())
def layer_norm_bwd(grad_out: Tensor, x: Tensor, normalized_shape: list[int], mean: Tensor, rstd: Tensor,
                   weight: Optional[Tensor], bias: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    m, n = rows_of(x, normalized_shape)
    if not use_triton(x, grad_out, weight, bias) or m == 0 or n == 0 or block_for(n) > MAX_BLOCK:
        mask = [True, weight is not None, bias is not None]
        dx, dw, db = aten.native_layer_norm_backward.default(grad_out, x, normalized_shape, mean, rstd, weight,
                                                             bias, mask)
        return dx, dw if dw is not None else empty_like_missing(x), db if db is not None else empty_like_missing(x)
    ln_bwd = _kernels()[1]
    xc, dyc = x.contiguous(), grad_out.contiguous()
    dx = torch.empty_like(xc)
    g = reduce_programs(x, m)
    dwp = torch.empty((g, n), device=x.device, dtype=torch.float32) if weight is not None else dx
    dbp = torch.empty((g, n), device=x.device, dtype=torch.float32) if bias is not None else dx
    block = block_for(n)
    ln_bwd[(g,)](dyc, xc, flat_or(weight, xc), mean.contiguous(), rstd.contiguous(), dx, dwp, dbp,
                 m, n, g, HAS_W=weight is not None, HAS_B=bias is not None, BLOCK=block, num_warps=warps_for(block))
    dw = dwp.sum(0).to(weight.dtype).view(weight.shape) if weight is not None else empty_like_missing(x)
    db = dbp.sum(0).to(bias.dtype).view(bias.shape) if bias is not None else empty_like_missing(x)
    return dx.view(x.shape), dw, db


@layer_norm_bwd.register_fake
def _(grad_out, x, normalized_shape, mean, rstd, weight, bias):
    dx, dw, db = aten.native_layer_norm_backward.default(grad_out, x, normalized_shape, mean, rstd, weight, bias,
                                                         [True, weight is not None, bias is not None])
    return dx, dw if dw is not None else empty_like_missing(x), db if db is not None else empty_like_missing(x)


# --- RMSNorm -----------------------------------------------------------------------------------

def rms_eps(eps: Optional[float]) -> float:
    # aten._fused_rms_norm: None means the machine epsilon of the fp32 computation type
    return torch.finfo(torch.float32).eps if eps is None else float(eps)


@torch.library.custom_op("fxspeed::rms_norm_fwd", mutates_args=())
def rms_norm_fwd(x: Tensor, normalized_shape: list[int], weight: Optional[Tensor],
                 eps: Optional[float], out_dtype: Optional[torch.dtype] = None) -> tuple[Tensor, Tensor]:
    m, n = rows_of(x, normalized_shape)
    if not use_triton(x, weight) or m == 0 or n == 0 or block_for(n) > MAX_BLOCK:
        out, rstd = aten._fused_rms_norm.default(x, normalized_shape, weight, eps)
        return as_dtype(out, out_dtype), rstd
    rms_fwd = _kernels()[2]
    xc = x.contiguous()
    y = torch.empty_like(xc, dtype=out_dtypes(x.dtype, out_dtype)[0])
    rstd = torch.empty(m, device=x.device, dtype=torch.float32)
    block = block_for(n)
    rms_fwd[(m,)](xc, flat_or(weight, xc), y, rstd, n, rms_eps(eps), HAS_W=weight is not None,
                  BLOCK=block, ROUND_BF16=round_bf16(y), num_warps=warps_for(block))
    return as_dtype(y.view(x.shape), out_dtype), rstd.view(stat_shape(x, normalized_shape))


@rms_norm_fwd.register_fake
def _(x, normalized_shape, weight, eps, out_dtype=None):
    out, rstd = aten._fused_rms_norm.default(x, normalized_shape, weight, eps)
    return as_dtype(out, out_dtype), rstd


def rms_norm_backward_reference(grad_out: Tensor, x: Tensor, normalized_shape: Sequence[int], rstd: Tensor,
                                weight: Optional[Tensor]) -> tuple[Tensor, Optional[Tensor]]:
    """aten._fused_rms_norm_backward's formula in torch (ATen has no CPU kernel for it)."""
    axis = x.dim() - len(normalized_shape)
    inner = list(range(axis, x.dim()))
    n = math.prod(normalized_shape)
    dy, xf = grad_out.float(), x.float()
    r = rstd.float().reshape(stat_shape(x, normalized_shape))
    wdy = dy * weight.float() if weight is not None else dy
    xhat = xf * r
    dx = (wdy - xhat / n * (xhat * wdy).sum(inner, keepdim=True)) * r
    dw = (dy * xhat).sum(list(range(axis))).to(weight.dtype) if weight is not None else None
    return dx.to(x.dtype), dw


@torch.library.custom_op("fxspeed::rms_norm_bwd", mutates_args=())
def rms_norm_bwd(grad_out: Tensor, x: Tensor, normalized_shape: list[int], rstd: Tensor,
                 weight: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    m, n = rows_of(x, normalized_shape)
    if not use_triton(x, grad_out, weight) or m == 0 or n == 0 or block_for(n) > MAX_BLOCK:
        if x.is_cuda:  # ATen's kernel
            dx, dw = aten._fused_rms_norm_backward.default(grad_out, x, normalized_shape, rstd, weight,
                                                           [True, weight is not None])
        else:
            dx, dw = rms_norm_backward_reference(grad_out, x, normalized_shape, rstd, weight)
        return dx, dw if dw is not None else empty_like_missing(x)
    rms_bwd = _kernels()[3]
    xc, dyc = x.contiguous(), grad_out.contiguous()
    dx = torch.empty_like(xc)
    g = reduce_programs(x, m)
    dwp = torch.empty((g, n), device=x.device, dtype=torch.float32) if weight is not None else dx
    block = block_for(n)
    rms_bwd[(g,)](dyc, xc, flat_or(weight, xc), rstd.contiguous(), dx, dwp, m, n, g,
                  HAS_W=weight is not None, BLOCK=block, num_warps=warps_for(block))
    dw = dwp.sum(0).to(weight.dtype).view(weight.shape) if weight is not None else empty_like_missing(x)
    return dx.view(x.shape), dw


@rms_norm_bwd.register_fake
def _(grad_out, x, normalized_shape, rstd, weight):
    dx, dw = aten._fused_rms_norm_backward.default(grad_out, x, normalized_shape, rstd, weight,
                                                   [True, weight is not None])
    return dx, dw if dw is not None else empty_like_missing(x)


__all__ = ["MAX_BLOCK", "as_dtype", "layer_norm_bwd", "layer_norm_fwd", "rms_norm_backward_reference", "rms_norm_bwd",
           "rms_norm_fwd", "out_dtypes", "round_bf16", "triton_available", "use_triton"]
