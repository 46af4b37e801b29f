"""Rotary position embedding (Hugging Face's rotate_half convention), forward and backward, as one
Triton kernel wrapped in torch custom ops.

`passes/graph/rotary_pattern.py` puts these ops into graphs in place of the ATen ops that HF's
Llama / Mistral / Qwen2 `apply_rotary_pos_emb` and its autograd backward record:

    fxspeed::rotary_fwd(x, cos, sin, out_dtype=None) -> out
        out = x * cos + rotate_half(x) * sin,   rotate_half(x) = cat(-x[..., D/2:], x[..., :D/2])
    fxspeed::rotary_bwd(grad_out, cos, sin, out_dtype=None) -> grad_x
        grad_x = grad_out * cos + rotate_half^T(grad_out * sin),
        rotate_half^T(y) = cat(y[..., D/2:], -y[..., :D/2])      (the transpose of rotate_half)

x / grad_out: [..., D] with D even (HF: [B, H, S, D]); cos and sin broadcast against it (HF:
[B or 1, 1, S, D] after `unsqueeze(1)`). Rotary is linear in x, so its input gradient reads only
grad_out, cos and sin. The gradients of cos and sin are not computed (HF's are constants of the
position ids: no gradient flows to them).

Numerics: every product and sum is computed in fp32 (exact upcasts of bf16/fp16 operands) and
rounded once to `out_dtype`: by default the promoted dtype of (x, cos, sin), which is what ATen's
`x * cos + ...` gives; a lower dtype writes the result directly in it, which is the fp32 rotary
followed by a cast, bit for bit (the "cast folded into its consumer": half the bytes written).
The operations are ATen's, in ATen's order, each rounded as ATen rounds it (per element:
out[j] = x[j] cos[j] - x[j+D/2] sin[j] for j < D/2 and x[j] cos[j] + x[j-D/2] sin[j] above, two
fp32 products and one fp32 sum; the kernel is launched with fp fusion off so no FMA contracts
them), so forward results equal the unfused ops' exactly; backward results too, except that a
zero may come out with the other sign (the unfused graph adds slice_backward's +0 fill). The
kernel rounds fp32 to bf16 itself, as torch does (nearest, ties to even, NaN -> 0x7FC0):
Triton's interpreter truncates in `.to(tl.bfloat16)`, so the interpreted tests could not show the
folded cast exact otherwise; compiled, it is the rounding `.to` gives.

Layout: the forward's output has x's strides (`empty_like`; what `x * cos + ...` gives, its first
operand deciding), the backward's is contiguous (what autograd's `add(slice_backward(...) +
slice_backward(...), grad * cos)` gives, its first operand being a fresh contiguous tensor).

Implementation used: the Triton kernel when the tensors are on CUDA or TRITON_INTERPRET=1 (CPU,
interpreted), have at most 4 dims and kernel dtypes (runtime/kernels/norms.py's `use_triton`);
otherwise the torch fallback (`rotary_reference`, the same ATen ops as the unfused graph). Triton
is imported lazily, on the first kernel launch. The fake implementations give exactly the
outputs' shapes, dtypes and strides.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch

from .launch import MAX_BLOCK, block_for, interpreting, use_triton

Tensor = torch.Tensor

_DIMS = 4  # the kernel indexes [d0, d1, d2, D]; fewer dims are padded with size-1 leading dims
_TILE = 4096  # elements (rows x half-row columns) per program


# --- shapes and dtypes ------------------------------------------------------------------------

def _check(x: Tensor, cos: Tensor, sin: Tensor) -> None:
    if x.dim() < 1 or x.shape[-1] % 2:
        raise ValueError(f"rotary: the last dim of x must be even, got shape {tuple(x.shape)}")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dim() > x.dim() or any(s not in (1, n) for s, n in zip(reversed(t.shape), reversed(x.shape))):
            raise ValueError(f"rotary: {name} of shape {tuple(t.shape)} does not broadcast to x {tuple(x.shape)}")


def _out_dtype(x: Tensor, cos: Tensor, sin: Tensor, out_dtype: Optional[torch.dtype]) -> torch.dtype:
    """What `x * cos + rotate_half(x) * sin` has in ATen (all three have dims: plain promotion)."""
    if out_dtype is not None:
        return out_dtype
    return torch.promote_types(x.dtype, torch.promote_types(cos.dtype, sin.dtype))


def _math_dtype(x: Tensor, cos: Tensor, sin: Tensor) -> torch.dtype:
    """fp32, or fp64 when an operand is fp64 (never lower than the unfused ops' precision)."""
    return torch.promote_types(torch.float32, _out_dtype(x, cos, sin, None))


def _empty_out(x: Tensor, dtype: torch.dtype, backward: bool) -> Tensor:
    # forward: x's strides (ATen's `x * cos + ...`); backward: contiguous (see the module docstring)
    if backward:
        return torch.empty(x.shape, dtype=dtype, device=x.device)
    return torch.empty_like(x, dtype=dtype)


# --- the torch reference (also the fallback) ----------------------------------------------------

def rotate_half(x: Tensor) -> Tensor:
    """HF's rotate_half: cat(-x[..., D/2:], x[..., :D/2])."""
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def rotate_half_transposed(y: Tensor) -> Tensor:
    """The transpose of rotate_half (so its gradient map): cat(y[..., D/2:], -y[..., :D/2])."""
    h = y.shape[-1] // 2
    return torch.cat((y[..., h:], -y[..., :h]), dim=-1)


def rotary_reference(x: Tensor, cos: Tensor, sin: Tensor, out_dtype: Optional[torch.dtype] = None,
                     backward: bool = False) -> Tensor:
    """The rotary (or, `backward`, its input gradient for grad_out = x) in torch: the unfused
    graph's ATen ops in fp32, rounded once to `out_dtype`, in the fused ops' layout."""
    _check(x, cos, sin)
    acc = _math_dtype(x, cos, sin)
    xf, cf, sf = x.to(acc), cos.to(acc), sin.to(acc)
    if backward:
        ref = xf * cf + rotate_half_transposed(xf * sf)
    else:
        ref = xf * cf + rotate_half(xf) * sf
    dtype = _out_dtype(x, cos, sin, out_dtype)
    out = _empty_out(x, dtype, backward)
    if ref.dtype == dtype and ref.stride() == out.stride():
        return ref
    return out.copy_(ref)  # the cast (one rounding) and/or the fused op's layout


# --- the kernel -------------------------------------------------------------------------------

def _kernel() -> Any:
    """The Triton kernel (imports triton on first use); made once per TRITON_INTERPRET setting,
    since Triton decides at decoration time whether a kernel is interpreted."""
    return _make_kernel(interpreting())


@functools.cache
def _make_kernel(interpret: bool) -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def rotary(X, C, S, Y, M, N1, N2, HALF,
               sx0, sx1, sx2, sx3, sc0, sc1, sc2, sc3, ss0, ss1, ss2, ss3, sy0, sy1, sy2, sy3,
               BACKWARD: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
        # ROWS rows of [d0, d1, d2] (row r = (i0 * N1 + i1) * N2 + i2) by the first half of D
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, BLOCK)
        i2 = rows % N2
        i1 = (rows // N2) % N1
        i0 = rows // N2 // N1
        mask = (rows < M)[:, None] & (cols < HALF)[None, :]
        ox = (i0 * sx0 + i1 * sx1 + i2 * sx2)[:, None] + cols[None, :] * sx3
        oc = (i0 * sc0 + i1 * sc1 + i2 * sc2)[:, None] + cols[None, :] * sc3
        o_s = (i0 * ss0 + i1 * ss1 + i2 * ss2)[:, None] + cols[None, :] * ss3
        oy = (i0 * sy0 + i1 * sy1 + i2 * sy2)[:, None] + cols[None, :] * sy3
        x1 = tl.load(X + ox, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(X + ox + HALF * sx3, mask=mask, other=0.0).to(tl.float32)
        c1 = tl.load(C + oc, mask=mask, other=0.0).to(tl.float32)
        c2 = tl.load(C + oc + HALF * sc3, mask=mask, other=0.0).to(tl.float32)
        s1 = tl.load(S + o_s, mask=mask, other=0.0).to(tl.float32)
        s2 = tl.load(S + o_s + HALF * ss3, mask=mask, other=0.0).to(tl.float32)
        if BACKWARD:  # g c + rotate_half^T(g s): [g1 c1 + g2 s2, g2 c2 - g1 s1]
            y1 = x1 * c1 + x2 * s2
            y2 = x2 * c2 - x1 * s1
        else:  # x c + rotate_half(x) s: [x1 c1 - x2 s1, x2 c2 + x1 s2]
            y1 = x1 * c1 - x2 * s1
            y2 = x2 * c2 + x1 * s2
        if Y.dtype.element_ty == tl.bfloat16:
            # rounded as torch rounds, by hand: the interpreter's `.to(tl.bfloat16)` truncates
            b1 = y1.to(tl.uint32, bitcast=True)
            b2 = y2.to(tl.uint32, bitcast=True)
            b1 = tl.where(y1 != y1, 0x7FC0, (b1 + ((b1 >> 16) & 1) + 0x7FFF) >> 16)
            b2 = tl.where(y2 != y2, 0x7FC0, (b2 + ((b2 >> 16) & 1) + 0x7FFF) >> 16)
            tl.store(Y + oy, b1.to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=mask)
            tl.store(Y + oy + HALF * sy3, b2.to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=mask)
        else:
            tl.store(Y + oy, y1.to(Y.dtype.element_ty), mask=mask)
            tl.store(Y + oy + HALF * sy3, y2.to(Y.dtype.element_ty), mask=mask)

    return rotary


def _as_dims(t: Tensor, shape: torch.Size) -> Tensor:
    """`t` broadcast to `shape` (a view: broadcast dims get stride 0), padded to 4 dims."""
    t = t.expand(shape)
    return t.view((1,) * (_DIMS - t.dim()) + tuple(t.shape)) if t.dim() < _DIMS else t


def _launch(x: Tensor, cos: Tensor, sin: Tensor, out: Tensor, backward: bool) -> None:
    x4, c4, s4, y4 = (_as_dims(t, x.shape) for t in (x, cos, sin, out))
    n0, n1, n2, d = x4.shape
    half = d // 2
    block = block_for(half)
    m = n0 * n1 * n2
    rows = max(1, min(_TILE // block, block_for(m)))
    grid = ((m + rows - 1) // rows,)
    # fp fusion off: a fused multiply-add would round x1 c1 - x2 s1 once where ATen rounds thrice
    _kernel()[grid](x4, c4, s4, y4, m, n1, n2, half, *x4.stride(), *c4.stride(), *s4.stride(), *y4.stride(),
                    BACKWARD=backward, ROWS=rows, BLOCK=block, num_warps=4, enable_fp_fusion=False)


def _rotary(x: Tensor, cos: Tensor, sin: Tensor, out_dtype: Optional[torch.dtype], backward: bool) -> Tensor:
    _check(x, cos, sin)
    dtype = _out_dtype(x, cos, sin, out_dtype)
    if (not use_triton(x, cos, sin) or x.dim() > _DIMS or x.numel() == 0 or block_for(x.shape[-1] // 2) > MAX_BLOCK
            or dtype not in (torch.float32, torch.bfloat16, torch.float16)):
        return rotary_reference(x, cos, sin, out_dtype, backward)
    out = _empty_out(x, dtype, backward)
    _launch(x, cos, sin, out, backward)
    return out


# --- the ops ----------------------------------------------------------------------------------

@torch.library.custom_op("fxspeed::rotary_fwd", mutates_args=())
def rotary_fwd(x: Tensor, cos: Tensor, sin: Tensor, out_dtype: Optional[torch.dtype] = None) -> Tensor:
    return _rotary(x, cos, sin, out_dtype, backward=False)


@rotary_fwd.register_fake
def _(x, cos, sin, out_dtype=None):
    _check(x, cos, sin)
    return _empty_out(x, _out_dtype(x, cos, sin, out_dtype), backward=False)


@torch.library.custom_op("fxspeed::rotary_bwd", mutates_args=())
def rotary_bwd(grad_out: Tensor, cos: Tensor, sin: Tensor, out_dtype: Optional[torch.dtype] = None) -> Tensor:
    return _rotary(grad_out, cos, sin, out_dtype, backward=True)


@rotary_bwd.register_fake
def _(grad_out, cos, sin, out_dtype=None):
    _check(grad_out, cos, sin)
    return _empty_out(grad_out, _out_dtype(grad_out, cos, sin, out_dtype), backward=True)


__all__ = ["rotary_bwd", "rotary_fwd", "rotary_reference", "rotate_half", "rotate_half_transposed"]
