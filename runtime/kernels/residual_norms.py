"""A residual add fused into the LayerNorm / RMSNorm after it, and the norm's backward fused with
the add that accumulates the residual stream's gradient: Triton kernels wrapped in torch custom ops.

`passes/graph/residual_norm_pattern.py` puts these ops into graphs in place of an aten.add and
one of fuse_kernels' norm ops (runtime/kernels/norms.py):

    fxspeed::add_layer_norm_fwd(x, r, normalized_shape, weight?, bias?, eps, out_dtype?) -> (h, out, mean, rstd)
        h = aten.add(x, r); (out, mean, rstd) = fxspeed::layer_norm_fwd(h, ..., out_dtype)
    fxspeed::add_rms_norm_fwd(x, r, normalized_shape, weight?, eps?, out_dtype?) -> (h, out, rstd)
        h = aten.add(x, r); (out, rstd) = fxspeed::rms_norm_fwd(h, ..., out_dtype)
    fxspeed::layer_norm_bwd_add(grad_out, h, normalized_shape, mean, rstd, weight?, bias?, grad_h)
        -> (grad_input + grad_h, grad_weight, grad_bias)        fxspeed::layer_norm_bwd + aten.add
    fxspeed::rms_norm_bwd_add(grad_out, h, normalized_shape, rstd, weight?, grad_h)
        -> (grad_input + grad_h, grad_weight)                   fxspeed::rms_norm_bwd + aten.add

Pre-norm transformers compute `h = x + sublayer(...); y = norm(h)` and, in backward, h's gradient
as `grad_h (from the next residual add) + norm_bwd(...).grad_input`. Unfused, h is written and
read back at once, and the norm's input gradient is written, read back and added: per row of C
elements the forward moves 5 C-wide tensors (read x, r; write h; read h; write out) and the
backward 6 (read dy, h; write dx; read dx, grad_h; write the sum). Fused: 4 and 4.

out_dtype (a cast folded into the norm, passes/graph/fold_norm_casts.py) is the norm ops' own:
out is exactly the op's out without it, `.to(out_dtype)`; h and the statistics are unchanged. The
kernel stores out in out_dtype directly when h is fp32 (rounded once, to nearest even, by hand
under Triton's interpreter as in norms.py), else converts after.

Kernels: one LayerNorm/RMSNorm kernel pair (RMS is a constexpr flag). Forward: one row per
program; h is computed in fp32, rounded to its dtype as ATen's add rounds it, stored, and that
rounded value is what the norm reads (so out/mean/rstd are exactly native_layer_norm(h)'s
computation, not a norm of the unrounded sum). Backward: the input gradient of each row in fp32
plus grad_h (loaded in fp32), rounded once; weight/bias gradients as in norms.py (G programs
walk rows pid, pid + G, ...; fp32 partial sums added by torch: deterministic, no atomics).

Dispatch, lazy Triton import, the fallback and fake implementations follow norms.py (and reuse
its helpers): the kernel runs on CUDA or under TRITON_INTERPRET=1 when the operands are what it
reads (same shape and dtype for x/r and dx/grad_h, contiguous, a row that fits one program);
otherwise the op is its definition, fxspeed's norm op plus aten.add, which is also the fake
implementation (so the fake gives exactly the unfused nodes' shapes, dtypes and strides).
"""

from __future__ import annotations

import functools
from typing import Any, Optional, Sequence

import torch

from .launch import (MAX_BLOCK, block_for, empty_like_missing, flat_or, interpreting, reduce_programs, rows_of,
                     stat_shape, use_triton, warps_for)
from .norms import as_dtype, layer_norm_bwd, layer_norm_fwd, out_dtypes, rms_eps, rms_norm_bwd, rms_norm_fwd, round_bf16

Tensor = torch.Tensor
aten = torch.ops.aten


# --- dispatch ---------------------------------------------------------------------------------

def _fits(a: Tensor, b: Tensor, normalized_shape: Sequence[int], *params: Optional[Tensor],
          same_dtype: bool = True) -> bool:
    """Whether the kernels take (a, b), the two C-wide operands of the add (x and r, or the input
    gradient's h and grad_h): one shape, contiguous (so the kernel's contiguous result has ATen's
    add's strides), one dtype (or, for x and r, any two kernel dtypes: fp32 + bf16 -> fp32 is what
    a bf16 sublayer added to an fp32 residual stream gives), a row that fits one program."""
    m, n = rows_of(a, normalized_shape)
    return (a.shape == b.shape and (a.dtype == b.dtype or not same_dtype) and a.is_contiguous()
            and b.is_contiguous() and m > 0 and n > 0 and block_for(n) <= MAX_BLOCK and use_triton(a, b, *params))


def _ln_stats_dtype(x: Tensor, *params: Optional[Tensor]) -> torch.dtype:
    # native_layer_norm's mean/rstd: fp32 on CUDA; on CPU the input's dtype, unless the weight or
    # bias has another dtype (ATen's "mixed type" CPU path keeps them in fp32)
    if x.device.type != "cpu" or any(p is not None and p.dtype != x.dtype for p in params):
        return torch.float32
    return x.dtype


@functools.cache
def _fused_kernels(interpret: bool) -> tuple[Any, Any]:  # noqa: ARG001  `interpret`: the cache key
    """(add_norm_fwd, norm_bwd_add): Triton decides when a kernel is decorated whether it runs
    interpreted, so one pair per TRITON_INTERPRET setting; triton is imported on first use."""
    import triton
    from triton import language as tl

    @triton.jit
    def add_norm_fwd(X, R, W, B, H, Y, Mean, Rstd, N, eps, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
                     RMS: tl.constexpr, BLOCK: tl.constexpr, ROUND_BF16: tl.constexpr):
        at = tl.program_id(0).to(tl.int64)  # this program's row
        cols = tl.arange(0, BLOCK)
        inside = cols < N
        offs = at * N + cols
        total = tl.load(X + offs, mask=inside, other=0.0).to(tl.float32) + \
            tl.load(R + offs, mask=inside, other=0.0).to(tl.float32)
        # round h as ATen's add does, and normalize that stored value (what native_layer_norm(h) reads)
        h_low = total.to(H.dtype.element_ty)
        tl.store(H + offs, h_low, mask=inside)
        h = h_low.to(tl.float32)
        if RMS:
            centered = h
        else:
            mu = tl.sum(h, axis=0) / N
            centered = tl.where(inside, h - mu, 0.0)
            tl.store(Mean + at, mu.to(Mean.dtype.element_ty))
        inv = 1.0 / tl.sqrt(tl.sum(centered * centered, axis=0) / N + eps)
        out = centered * inv
        if HAS_W:
            out *= tl.load(W + cols, mask=inside, other=0.0).to(tl.float32)
        if HAS_B:
            out += tl.load(B + cols, mask=inside, other=0.0).to(tl.float32)
        if ROUND_BF16:  # to nearest even, by hand (the interpreter's conversion truncates); then exact
            bits = out.to(tl.uint32, bitcast=True)
            out = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
        tl.store(Y + offs, out.to(Y.dtype.element_ty), mask=inside)
        tl.store(Rstd + at, inv.to(Rstd.dtype.element_ty))

    @triton.jit
    def norm_bwd_add(DY, H, GH, W, Mean, Rstd, DX, DWp, DBp, M, N, G, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
                     RMS: tl.constexpr, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        inside = cols < N
        gamma = tl.where(inside, 1.0, 0.0)  # the weight, 1 where there is none (0 past the row)
        if HAS_W:
            gamma = tl.load(W + cols, mask=inside, other=0.0).to(tl.float32)
        acc_w = tl.zeros([BLOCK], dtype=tl.float32)
        acc_b = tl.zeros([BLOCK], dtype=tl.float32)
        for i in range(pid, M, G):
            offs = tl.cast(i, tl.int64) * N + cols
            g = tl.load(DY + offs, mask=inside, other=0.0).to(tl.float32)
            h = tl.load(H + offs, mask=inside, other=0.0).to(tl.float32)
            inv = tl.load(Rstd + i).to(tl.float32)
            if RMS:
                xhat = h * inv
            else:
                xhat = tl.where(inside, (h - tl.load(Mean + i).to(tl.float32)) * inv, 0.0)
            gg = gamma * g
            proj = xhat * (tl.sum(xhat * gg, axis=0) / N)
            if not RMS:
                proj += tl.sum(gg, axis=0) / N
            # the norm's input gradient, still fp32, plus the residual gradient: one rounding
            dh = (gg - proj) * inv + tl.load(GH + offs, mask=inside, other=0.0).to(tl.float32)
            tl.store(DX + offs, dh.to(DX.dtype.element_ty), mask=inside)
            acc_w += g * xhat
            acc_b += g
        if HAS_W:
            tl.store(DWp + pid * N + cols, acc_w, mask=inside)
        if HAS_B:
            tl.store(DBp + pid * N + cols, acc_b, mask=inside)

    return add_norm_fwd, norm_bwd_add


def _launch_fwd(x: Tensor, r: Tensor, normalized_shape: Sequence[int], weight: Optional[Tensor],
                bias: Optional[Tensor], eps: float, rms: bool,
                out_dtype: Optional[torch.dtype] = None) -> tuple[Tensor, ...]:
    """(h, out, mean, rstd) from the forward kernel (mean: an empty tensor for RMSNorm, whose rstd
    is fp32 as aten._fused_rms_norm's; out in out_dtype when given)."""
    m, n = rows_of(x, normalized_shape)
    h = torch.empty_like(x, dtype=torch.promote_types(x.dtype, r.dtype))  # the dtype ATen's add gives
    out = torch.empty_like(h, dtype=out_dtypes(h.dtype, out_dtype)[0])
    stats = torch.float32 if rms else _ln_stats_dtype(h, weight, bias)
    mean = torch.empty(0 if rms else m, device=x.device, dtype=stats)
    rstd = torch.empty(m, device=x.device, dtype=stats)
    block = block_for(n)
    kernel = _fused_kernels(interpreting())[0]
    kernel[(m,)](x, r, flat_or(weight, x), flat_or(bias, x), h, out, mean if not rms else rstd, rstd, n, eps,
                 HAS_W=weight is not None, HAS_B=bias is not None, RMS=rms, BLOCK=block, ROUND_BF16=round_bf16(out),
                 num_warps=warps_for(block))
    shape = stat_shape(x, normalized_shape)
    return h, as_dtype(out, out_dtype), mean.view(shape) if not rms else mean, rstd.view(shape)


def _launch_bwd(grad_out: Tensor, h: Tensor, normalized_shape: Sequence[int], mean: Optional[Tensor], rstd: Tensor,
                weight: Optional[Tensor], bias: Optional[Tensor], grad_h: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(grad_input + grad_h, grad_weight, grad_bias) from the backward kernel; an absent
    parameter's gradient is an empty tensor (as fxspeed's norm ops return it)."""
    m, n = rows_of(h, normalized_shape)
    dyc = grad_out.contiguous()
    dh = torch.empty_like(h)
    g = reduce_programs(h, m)
    partial = {p: torch.empty((g, n), device=h.device, dtype=torch.float32) if t is not None else dh
               for p, t in (("w", weight), ("b", bias))}
    rc = rstd.contiguous()
    block = block_for(n)
    kernel = _fused_kernels(interpreting())[1]
    kernel[(g,)](dyc, h, grad_h, flat_or(weight, h), mean.contiguous() if mean is not None else rc, rc, dh,
                 partial["w"], partial["b"], m, n, g, HAS_W=weight is not None, HAS_B=bias is not None,
                 RMS=mean is None, BLOCK=block, num_warps=warps_for(block))

    def reduced(t: Optional[Tensor], part: Tensor) -> Tensor:
        return part.sum(0).to(t.dtype).view(t.shape) if t is not None else empty_like_missing(h)

    return dh, reduced(weight, partial["w"]), reduced(bias, partial["b"])


# --- LayerNorm ---------------------------------------------------------------------------------

def _add_layer_norm_reference(x: Tensor, r: Tensor, normalized_shape: list[int], weight: Optional[Tensor],
                              bias: Optional[Tensor], eps: float,
                              out_dtype: Optional[torch.dtype] = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    h = aten.add.Tensor(x, r)
    return (h, *layer_norm_fwd(h, normalized_shape, weight, bias, eps, out_dtype))


@torch.library.custom_op("fxspeed::add_layer_norm_fwd", mutates_args=())
def add_layer_norm_fwd(x: Tensor, r: Tensor, normalized_shape: list[int], weight: Optional[Tensor],
                       bias: Optional[Tensor], eps: float,
                       out_dtype: Optional[torch.dtype] = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    if not _fits(x, r, normalized_shape, weight, bias, same_dtype=False):
        return _add_layer_norm_reference(x, r, normalized_shape, weight, bias, eps, out_dtype)
    return _launch_fwd(x, r, normalized_shape, weight, bias, float(eps), False, out_dtype)


add_layer_norm_fwd.register_fake(_add_layer_norm_reference)


def _layer_norm_bwd_add_reference(grad_out: Tensor, h: Tensor, normalized_shape: list[int], mean: Tensor, rstd: Tensor,
                                  weight: Optional[Tensor], bias: Optional[Tensor],
                                  grad_h: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    dx, dw, db = layer_norm_bwd(grad_out, h, normalized_shape, mean, rstd, weight, bias)
    return aten.add.Tensor(dx, grad_h), dw, db


@torch.library.custom_op("fxspeed::layer_norm_bwd_add", mutates_args=())
def layer_norm_bwd_add(grad_out: Tensor, h: Tensor, normalized_shape: list[int], mean: Tensor, rstd: Tensor,
                       weight: Optional[Tensor], bias: Optional[Tensor],
                       grad_h: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    if not _fits(h, grad_h, normalized_shape, grad_out, weight, bias):
        return _layer_norm_bwd_add_reference(grad_out, h, normalized_shape, mean, rstd, weight, bias, grad_h)
    return _launch_bwd(grad_out, h, normalized_shape, mean, rstd, weight, bias, grad_h)


layer_norm_bwd_add.register_fake(_layer_norm_bwd_add_reference)


# --- RMSNorm -----------------------------------------------------------------------------------

def _add_rms_norm_reference(x: Tensor, r: Tensor, normalized_shape: list[int], weight: Optional[Tensor],
                            eps: Optional[float],
                            out_dtype: Optional[torch.dtype] = None) -> tuple[Tensor, Tensor, Tensor]:
    h = aten.add.Tensor(x, r)
    return (h, *rms_norm_fwd(h, normalized_shape, weight, eps, out_dtype))


@torch.library.custom_op("fxspeed::add_rms_norm_fwd", mutates_args=())
def add_rms_norm_fwd(x: Tensor, r: Tensor, normalized_shape: list[int], weight: Optional[Tensor],
                     eps: Optional[float], out_dtype: Optional[torch.dtype] = None) -> tuple[Tensor, Tensor, Tensor]:
    if not _fits(x, r, normalized_shape, weight, same_dtype=False):
        return _add_rms_norm_reference(x, r, normalized_shape, weight, eps, out_dtype)
    h, out, _, rstd = _launch_fwd(x, r, normalized_shape, weight, None, rms_eps(eps), True, out_dtype)
    return h, out, rstd


add_rms_norm_fwd.register_fake(_add_rms_norm_reference)


def _rms_norm_bwd_add_reference(grad_out: Tensor, h: Tensor, normalized_shape: list[int], rstd: Tensor,
                                weight: Optional[Tensor], grad_h: Tensor) -> tuple[Tensor, Tensor]:
    dx, dw = rms_norm_bwd(grad_out, h, normalized_shape, rstd, weight)
    return aten.add.Tensor(dx, grad_h), dw


@torch.library.custom_op("fxspeed::rms_norm_bwd_add", mutates_args=())
def rms_norm_bwd_add(grad_out: Tensor, h: Tensor, normalized_shape: list[int], rstd: Tensor,
                     weight: Optional[Tensor], grad_h: Tensor) -> tuple[Tensor, Tensor]:
    if not _fits(h, grad_h, normalized_shape, grad_out, weight):
        return _rms_norm_bwd_add_reference(grad_out, h, normalized_shape, rstd, weight, grad_h)
    dh, dw, _ = _launch_bwd(grad_out, h, normalized_shape, None, rstd, weight, None, grad_h)
    return dh, dw


rms_norm_bwd_add.register_fake(_rms_norm_bwd_add_reference)


__all__ = ["add_layer_norm_fwd", "add_rms_norm_fwd", "layer_norm_bwd_add", "rms_norm_bwd_add"]
