"""SwiGLU and GELU, forward and backward, as elementwise Triton kernels wrapped in torch custom ops.

`passes/graph/activation_pattern.py` puts these ops into graphs in place of the ATen ops that
Hugging Face's Llama-style gated MLPs, GPT-2's written-out "gelu_new", `aten.gelu` and Falcon's
separate bias add record:

    fxspeed::swiglu_fwd(gate, up, out_dtype=None) -> out
        out = silu(gate) * up                          (aten.mul(aten.silu(gate), up))
    fxspeed::swiglu_bwd(grad_out, gate, up, gate_dtype=None, up_dtype=None) -> (grad_gate, grad_up)
        grad_gate = grad_out * up * sigmoid(gate) * (1 + gate * (1 - sigmoid(gate)))
        grad_up = grad_out * silu(gate)               (silu recomputed from gate: backward keeps
                                                       gate and up, not silu(gate) as well)
    fxspeed::gelu_fwd(x, approximate="none", bias=None, out_dtype=None) -> out
        aten.gelu(x + bias, approximate)               "none" (erf) or "tanh"
    fxspeed::gelu_bwd(grad_out, x, approximate="none", bias=None, out_dtype=None) -> grad_x
        aten.gelu_backward(grad_out, x + bias, approximate); the gradient of the sum, so of x and
        (summed over the leading dims, outside the op) of the bias

`bias`: a 1-D tensor of x's last dim, added inside the kernel (a bias add of its own before the
activation, as Falcon's FalconLinear records, is folded in; backward then keeps x, not x + bias).

Numerics: every input is read in its dtype, the whole formula is computed in fp32 (fp64 in the
fallback for fp64 inputs) and each output is rounded once, to `out_dtype` (`gate_dtype` /
`up_dtype`) when given, else to the promoted dtype of the inputs, which is what the ATen ops give.
A lower `out_dtype` than that is the fp32 result followed by a cast (a cast folded into the op);
a higher one is the dtype a mixed-precision graph computed the unfused region in. The unfused
ops round every intermediate to its dtype; in fp32 the results agree to rounding, in bf16/fp16
the fused ones are the more accurate (one rounding instead of several). Compiled kernels round to
nearest; Triton's interpreter truncates in `.to(tl.bfloat16)` (one bf16 ulp at most: the tests'
tolerances allow it). tanh is computed from exp (the interpreter runs no libdevice tanh).

Layout: the kernels run on contiguous inputs of one shape (bias aside) and write contiguous
outputs, which is what ATen's elementwise ops give for them; any other layout (or broadcasting)
runs the torch fallback, which is ATen's ops themselves and so ATen's layout. The fake
implementations are the fallback run on fake tensors, so they give exactly the outputs' shapes,
dtypes and strides.

Implementation used: the Triton kernel when the tensors are on CUDA or TRITON_INTERPRET=1 (CPU,
interpreted) and have kernel dtypes (runtime/kernels/norms.py's `use_triton`); otherwise the torch
fallback. Triton is imported lazily, on the first kernel launch, never when fxspeed is imported.
Kernels: one 1-D blocked grid over numel (BLOCK elements per program, int64 offsets).
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch
import torch.nn.functional as F

from .launch import KERNEL_DTYPES, interpreting, use_triton

Tensor = torch.Tensor
aten = torch.ops.aten

_BLOCK = 1024  # elements per program: 4 warps x 32 threads x 8 elements
_APPROXIMATE = ("none", "tanh")


# --- dtypes and the torch fallback -------------------------------------------------------------

def _promoted(*ts: Optional[Tensor]) -> torch.dtype:
    """The dtype ATen's elementwise ops give for these operands (all have dims: plain promotion)."""
    dtype = None
    for t in ts:
        if t is not None:
            dtype = t.dtype if dtype is None else torch.promote_types(dtype, t.dtype)
    return dtype


def _math_dtype(*ts: Optional[Tensor]) -> torch.dtype:
    """fp32, or fp64 when an operand is fp64 (never below the unfused ops' precision)."""
    return torch.promote_types(torch.float32, _promoted(*ts))


def _check_approximate(approximate: str) -> None:
    if approximate not in _APPROXIMATE:
        raise ValueError(f"gelu: approximate must be one of {_APPROXIMATE}, got {approximate!r}")


def _check_bias(x: Tensor, bias: Optional[Tensor]) -> None:
    if bias is not None and (bias.dim() != 1 or x.dim() < 1 or bias.shape[0] != x.shape[-1]):
        raise ValueError(f"gelu: bias must be 1-D of x's last dim, got {tuple(bias.shape)} for x {tuple(x.shape)}")


def swiglu_reference(gate: Tensor, up: Tensor, out_dtype: Optional[torch.dtype] = None) -> Tensor:
    """silu(gate) * up in torch, computed in fp32 and rounded once (the fallback and the fake)."""
    c = _math_dtype(gate, up)
    return (F.silu(gate.to(c)) * up.to(c)).to(out_dtype or _promoted(gate, up))


def swiglu_backward_reference(grad_out: Tensor, gate: Tensor, up: Tensor, gate_dtype: Optional[torch.dtype] = None,
                              up_dtype: Optional[torch.dtype] = None) -> tuple[Tensor, Tensor]:
    """(grad_gate, grad_up) of silu(gate) * up in torch, in fp32, each rounded once."""
    c = _math_dtype(grad_out, gate, up)
    dy, g, u = grad_out.to(c), gate.to(c), up.to(c)
    sig = torch.sigmoid(g)
    grad_gate = dy * u * (sig * (1 + g * (1 - sig)))  # silu'(g) as ATen's silu_backward writes it
    grad_up = dy * (g * sig)
    return (grad_gate.to(gate_dtype or _promoted(grad_out, gate, up)),
            grad_up.to(up_dtype or _promoted(grad_out, gate)))


def gelu_reference(x: Tensor, approximate: str = "none", bias: Optional[Tensor] = None,
                   out_dtype: Optional[torch.dtype] = None) -> Tensor:
    """aten.gelu(x + bias) in torch, computed in fp32 and rounded once."""
    _check_approximate(approximate)
    _check_bias(x, bias)
    c = _math_dtype(x, bias)
    h = x.to(c) if bias is None else x.to(c) + bias.to(c)
    return F.gelu(h, approximate=approximate).to(out_dtype or _promoted(x, bias))


def gelu_backward_reference(grad_out: Tensor, x: Tensor, approximate: str = "none", bias: Optional[Tensor] = None,
                            out_dtype: Optional[torch.dtype] = None) -> Tensor:
    """aten.gelu_backward(grad_out, x + bias) in torch, computed in fp32 and rounded once."""
    _check_approximate(approximate)
    _check_bias(x, bias)
    c = _math_dtype(grad_out, x, bias)
    h = x.to(c) if bias is None else x.to(c) + bias.to(c)
    return aten.gelu_backward.default(grad_out.to(c), h, approximate=approximate).to(
        out_dtype or _promoted(grad_out, x, bias))


# --- the kernels --------------------------------------------------------------------------------

def _kernels() -> Any:
    """The Triton kernels (imports triton on first use); made once per TRITON_INTERPRET setting,
    since Triton decides at decoration time whether a kernel is interpreted."""
    return _make_kernels(interpreting())


@functools.cache
def _make_kernels(interpret: bool) -> Any:
    import triton
    import triton.language as tl

    # one kernel per activation, BACKWARD choosing the direction: the interpreter runs a kernel
    # from its module's globals, so kernels made here cannot call helper jit functions made here

    @triton.jit
    def swiglu(DY, G, U, Y, DU, numel, BACKWARD: tl.constexpr, BLOCK: tl.constexpr):
        # forward: Y = silu(g) u; backward: Y = grad_gate, DU = grad_up
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < numel
        g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
        s = 1.0 / (1.0 + tl.exp(-g))
        if BACKWARD:
            dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(Y + offs, (dy * u * (s * (1.0 + g * (1.0 - s)))).to(Y.dtype.element_ty), mask=mask)
            tl.store(DU + offs, (dy * (g * s)).to(DU.dtype.element_ty), mask=mask)
        else:
            tl.store(Y + offs, (g * s * u).to(Y.dtype.element_ty), mask=mask)

    @triton.jit
    def gelu(DY, X, B, Y, numel, N, HAS_BIAS: tl.constexpr, TANH: tl.constexpr, BACKWARD: tl.constexpr,
             BLOCK: tl.constexpr):
        # forward: Y = gelu(x + b); backward: Y = dy gelu'(x + b); ATen's formulas
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < numel
        x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            x += tl.load(B + offs % N, mask=mask, other=0.0).to(tl.float32)
        if TANH:
            k = 0.7978845608028654  # sqrt(2 / pi)
            z = k * (x + 0.044715 * x * x * x)
            # Triton has no tanh that the interpreter runs (libdevice is compiled-only): from
            # exp(-2|z|), which never overflows; absolute error a few ulp of 1, what 1 + t and 1 - t^2 need
            e = tl.exp(-2.0 * tl.abs(z))
            t = (1.0 - e) / (1.0 + e)
            t = tl.where(z < 0.0, -t, t)
            right = 1.0 + t
            y = 0.5 * x * right
            d = 0.5 * right + 0.5 * x * (1.0 - t * t) * k * (1.0 + 3.0 * 0.044715 * x * x)
        else:
            cdf = 0.5 * (1.0 + tl.math.erf(x * 0.7071067811865476))  # 1 / sqrt(2)
            y = x * cdf
            d = cdf + x * tl.exp(-0.5 * x * x) * 0.3989422804014327  # 1 / sqrt(2 pi)
        if BACKWARD:
            dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(Y + offs, (dy * d).to(Y.dtype.element_ty), mask=mask)
        else:
            tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)

    return swiglu, gelu


def _on_kernel(tensors: tuple[Tensor, ...], out_dtypes: tuple[torch.dtype, ...], bias: Optional[Tensor] = None) -> bool:
    """Whether the Triton kernel computes this call: kernel device and dtypes, one shape, contiguous
    (anything else: the fallback, ATen's broadcasting and layout)."""
    x = tensors[0]
    return (use_triton(*tensors, bias) and x.numel() > 0 and all(d in KERNEL_DTYPES for d in out_dtypes)
            and all(t.shape == x.shape and t.is_contiguous() for t in tensors)
            and (bias is None or bias.is_contiguous()))


def _grid(numel: int) -> tuple[int]:
    return ((numel + _BLOCK - 1) // _BLOCK,)


# --- SwiGLU ------------------------------------------------------------------------------------

@torch.library.custom_op("fxspeed::swiglu_fwd", mutates_args=())
def swiglu_fwd(gate: Tensor, up: Tensor, out_dtype: Optional[torch.dtype] = None) -> Tensor:
    dtype = out_dtype or _promoted(gate, up)
    if not _on_kernel((gate, up), (dtype,)):
        return swiglu_reference(gate, up, out_dtype)
    out = torch.empty(gate.shape, dtype=dtype, device=gate.device)
    _kernels()[0][_grid(gate.numel())](gate, gate, up, out, out, gate.numel(), BACKWARD=False, BLOCK=_BLOCK,
                                       num_warps=4)
    return out


swiglu_fwd.register_fake(swiglu_reference)


@torch.library.custom_op("fxspeed::swiglu_bwd", mutates_args=())
def swiglu_bwd(grad_out: Tensor, gate: Tensor, up: Tensor, gate_dtype: Optional[torch.dtype] = None,
               up_dtype: Optional[torch.dtype] = None) -> tuple[Tensor, Tensor]:
    gd, ud = gate_dtype or _promoted(grad_out, gate, up), up_dtype or _promoted(grad_out, gate)
    if not _on_kernel((grad_out, gate, up), (gd, ud)):
        return swiglu_backward_reference(grad_out, gate, up, gate_dtype, up_dtype)
    grad_gate = torch.empty(gate.shape, dtype=gd, device=gate.device)
    grad_up = torch.empty(gate.shape, dtype=ud, device=gate.device)
    _kernels()[0][_grid(gate.numel())](grad_out, gate, up, grad_gate, grad_up, gate.numel(), BACKWARD=True,
                                       BLOCK=_BLOCK, num_warps=4)
    return grad_gate, grad_up


swiglu_bwd.register_fake(swiglu_backward_reference)


def _launch_gelu(grad_out: Tensor, x: Tensor, approximate: str, bias: Optional[Tensor], out: Tensor,
                 backward: bool) -> None:
    _kernels()[1][_grid(x.numel())](grad_out, x, bias if bias is not None else x, out, x.numel(), x.shape[-1],
                                    HAS_BIAS=bias is not None, TANH=approximate == "tanh", BACKWARD=backward,
                                    BLOCK=_BLOCK, num_warps=4)


# --- GELU --------------------------------------------------------------------------------------

@torch.library.custom_op("fxspeed::gelu_fwd", mutates_args=())
def gelu_fwd(x: Tensor, approximate: str = "none", bias: Optional[Tensor] = None,
             out_dtype: Optional[torch.dtype] = None) -> Tensor:
    dtype = out_dtype or _promoted(x, bias)
    if approximate not in _APPROXIMATE or not _on_kernel((x,), (dtype,), bias):
        return gelu_reference(x, approximate, bias, out_dtype)
    _check_bias(x, bias)
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    _launch_gelu(x, x, approximate, bias, out, backward=False)
    return out


gelu_fwd.register_fake(gelu_reference)


@torch.library.custom_op("fxspeed::gelu_bwd", mutates_args=())
def gelu_bwd(grad_out: Tensor, x: Tensor, approximate: str = "none", bias: Optional[Tensor] = None,
             out_dtype: Optional[torch.dtype] = None) -> Tensor:
    dtype = out_dtype or _promoted(grad_out, x, bias)
    if approximate not in _APPROXIMATE or not _on_kernel((grad_out, x), (dtype,), bias):
        return gelu_backward_reference(grad_out, x, approximate, bias, out_dtype)
    _check_bias(x, bias)
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    _launch_gelu(grad_out, x, approximate, bias, out, backward=True)
    return out


gelu_bwd.register_fake(gelu_backward_reference)


__all__ = ["gelu_backward_reference", "gelu_bwd", "gelu_fwd", "gelu_reference",
           "swiglu_backward_reference", "swiglu_bwd", "swiglu_fwd", "swiglu_reference"]
