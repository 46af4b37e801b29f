"""Fused rotary embedding: the kernels (runtime/kernels/rotary.py) and the matcher that puts them
into training graphs (passes/graph/rotary_pattern.py), casts to bf16 folded in.

The kernel tests run under Triton's interpreter in a child pytest started with TRITON_INTERPRET=1
(why: see tests/test_fusion_kernels.py), and are skipped in a process without it; the graph tests
run the ops' torch fallback here (and one of them the kernels in the child). The fused ops compute
the matched ATen ops exactly (fp32 math in ATen's order, one rounding to the output dtype), so
losses and gradients are compared for equality, not closeness.
"""

from __future__ import annotations

import copy
import sys

import pytest
import torch
import torch.nn as nn
from conftest import INTERPRETING, assert_close_rel, fxspeed_train, needs_interpreter, run_interpreted
from hypothesis import given, settings
from hypothesis import strategies as st

import fxspeed
from fxspeed.compiler.pipelines import compile_step
from fxspeed.passes.graph import rotary_pattern
from fxspeed.passes.graph.rotary_pattern import find_rotaries, fuse_rotary
from fxspeed.runtime.kernels import rotary
from fxspeed.runtime.kernels.norms import triton_available
from test_fusion_kernels import UNFUSED, count_targets, hf_batches, run_step, step_inputs, tiny_hf

INTERPRETED_TESTS = ("test_rotary_kernels_compute_the_unfused_aten_ops_bit_for_bit_forward_and_backward",
                     "test_a_low_precision_result_is_rounded_as_torch_rounds_ties_nan_inf_and_overflow_included",
                     "test_hand_written_rotaries_are_fused_exactly_when_they_are_hf_s_and_compute_the_same[hf]")
FWD, BWD = "fxspeed.rotary_fwd.default", "fxspeed.rotary_bwd.default"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}




def test_the_rotary_kernels_pass_their_tests_under_triton_s_interpreter() -> None:
    """Runs INTERPRETED_TESTS in a child pytest that sets TRITON_INTERPRET=1 from the start."""
    run_interpreted(__file__, INTERPRETED_TESTS)


def identical(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    """Same shape, dtype and values (NaN equal to NaN; +0 equal to -0)."""
    assert a.shape == b.shape and a.dtype == b.dtype, f"{what}: {a.shape} {a.dtype} vs {b.shape} {b.dtype}"
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True, msg=lambda m: f"{what}: {m}")


def same_strides(a: torch.Tensor, b: torch.Tensor) -> bool:
    return all(s == t for s, t, k in zip(a.stride(), b.stride(), a.shape) if k > 1)


# --- the kernels ---------------------------------------------------------------------------------

def unfused(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's apply_rotary_pos_emb on one tensor, as written there (fp32 operands: fp32 math)."""
    h = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., h:], x[..., :h]), dim=-1) * sin


def rotary_inputs(b: int, heads: int, s: int, d: int, dtype: torch.dtype, cos_dtype: torch.dtype, layout: str,
                  cos_form: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [B, H, S, D] (contiguous, or HF's transpose of [B, S, H, D]); cos/sin as `cos_form`."""
    x = torch.randn(b, heads, s, d).to(dtype) if layout == "contiguous" else \
        torch.randn(b, s, heads, d).to(dtype).transpose(1, 2)
    shape = {"[1, 1, S, D]": (1, 1, s, d), "[B, 1, S, D]": (b, 1, s, d), "[S, D]": (s, d)}[cos_form]
    angles = torch.rand(shape) * 6.3
    return x, angles.cos().to(cos_dtype), angles.sin().to(cos_dtype)


@settings(max_examples=8, deadline=None, derandomize=True)
@given(shape=st.tuples(st.integers(1, 3), st.integers(1, 4), st.integers(1, 9), st.sampled_from(range(2, 42, 2))),
       dtype=st.sampled_from(sorted(DTYPES)), cos_fp32=st.booleans(), out=st.sampled_from([None, "bf16", "fp16"]),
       layout=st.sampled_from(["contiguous", "transposed"]),
       cos_form=st.sampled_from(["[1, 1, S, D]", "[B, 1, S, D]", "[S, D]"]))
def test_rotary_kernels_compute_the_unfused_aten_ops_bit_for_bit_forward_and_backward(
        shape, dtype, cos_fp32, out, layout, cos_form) -> None:
    """rotary_fwd = the ATen ops of apply_rotary_pos_emb in fp32, then (out_dtype) one cast;
    rotary_bwd = autograd's gradient through them; forward in x's layout, backward contiguous."""
    needs_interpreter()
    dt = DTYPES[dtype]
    x, cos, sin = rotary_inputs(*shape, dt, torch.float32 if cos_fp32 else dt, layout, cos_form)
    g = torch.randn(shape).to(dt)
    assert rotary.use_triton(x, cos, sin)
    out_dtype = DTYPES[out] if out else None
    xf = x.float().requires_grad_()  # .float() keeps x's strides
    ref = unfused(xf, cos.float(), sin.float())
    want = torch.promote_types(dt, cos.dtype) if out_dtype is None else out_dtype
    y = rotary.rotary_fwd(x, cos, sin, out_dtype)
    identical(y, ref.detach().to(want), "forward")
    assert same_strides(y, ref), f"forward strides {y.stride()} vs ATen's {ref.stride()}"
    (ref_dx,) = torch.autograd.grad(ref, xf, g.float())
    dx = rotary.rotary_bwd(g, cos, sin, out_dtype)
    identical(dx, ref_dx.to(want), "backward")
    assert dx.is_contiguous()
    assert rotary._make_kernel.cache_info().currsize == 1, "the Triton kernel ran"


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy's inf * 0 (a NaN is meant)
@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # the interpreter's fp16 inf (meant)
def test_a_low_precision_result_is_rounded_as_torch_rounds_ties_nan_inf_and_overflow_included() -> None:
    """x = [values, zeros], cos = 1, sin = 0: the first half of the rotary (and of its backward) is
    `values` exactly, so its bf16/fp16 result is their rounding: ties to even both ways, just
    below and above a tie, the largest fp32 (rounds to inf), NaN, infinities, subnormals, -0."""
    needs_interpreter()
    bits = torch.tensor([0x3F808000, 0x3F818000, 0x3F807FFF, 0x3F808001, 0x7F7FFFFF, 0xFF7FFFFF, 0x7FC00000,
                         0x7F800000, 0xFF800000, 0x00000001, 0x80008000, 0x80000000, 0x00018000, 0x477FF000,
                         0x3F801000, 0x3F803000], dtype=torch.int64).to(torch.int32)
    values = bits.view(torch.float32)
    x = torch.cat((values, torch.zeros_like(values))).view(1, 1, 1, -1)
    cos, sin = torch.ones_like(x), torch.zeros_like(x)
    assert rotary.use_triton(x, cos, sin)
    xr = x.clone().requires_grad_()
    ref = unfused(xr, cos, sin)
    (ref_dx,) = torch.autograd.grad(ref, xr, x)  # grad_out = x
    for low in (torch.bfloat16, torch.float16):
        y = rotary.rotary_fwd(x, cos, sin, low)
        identical(y[..., :len(values)], values.view(1, 1, 1, -1).to(low), f"{low} rounding")
        identical(y, ref.detach().to(low), f"{low} forward")
        identical(rotary.rotary_bwd(x, cos, sin, low), ref_dx.to(low), f"{low} backward")


def test_the_fake_implementations_give_the_real_outputs_shapes_dtypes_and_strides() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    cases = [rotary_inputs(2, 3, 5, 8, torch.bfloat16, torch.float32, "transposed", "[1, 1, S, D]"),
             rotary_inputs(2, 3, 5, 8, torch.float32, torch.float32, "contiguous", "[B, 1, S, D]"),
             rotary_inputs(1, 2, 4, 6, torch.float16, torch.float16, "transposed", "[S, D]")]
    for x, cos, sin in cases:
        for out_dtype in (None, torch.bfloat16):
            for op in (rotary.rotary_fwd, rotary.rotary_bwd):
                real = op(x, cos, sin, out_dtype)
                with FakeTensorMode() as mode:
                    fake = op(*(mode.from_tensor(t) for t in (x, cos, sin)), out_dtype)
                assert (fake.shape, fake.dtype, fake.stride()) == (real.shape, real.dtype, real.stride()), op


def test_an_odd_head_dim_or_cos_that_does_not_broadcast_to_x_is_refused() -> None:
    with pytest.raises(ValueError, match="even"):
        rotary.rotary_fwd(torch.randn(2, 5), torch.randn(5), torch.randn(5))
    with pytest.raises(ValueError, match="broadcast"):
        rotary.rotary_bwd(torch.randn(2, 4), torch.randn(3, 4), torch.randn(4))


# --- the matcher on Hugging Face models ----------------------------------------------------------

@pytest.fixture
def rotary_fused(monkeypatch) -> None:
    """fuse_kernels (and so fuse_rotary, after the norms) on CPU programs."""
    monkeypatch.setenv("FXSPEED_FUSE_ON_CPU", "1")


def low_and_fp32_rotary_tensors(gm: torch.fx.GraphModule) -> tuple[int, int]:
    """How many [B, H, S, D] values the fused ops read/write in bf16 and in fp32."""
    vals = [v for n in gm.graph.nodes if str(n.target) in (FWD, BWD)
            for v in (n.args[0].meta["val"], n.meta["val"])]
    return sum(v.dtype == torch.bfloat16 for v in vals), sum(v.dtype == torch.float32 for v in vals)


@pytest.mark.parametrize("kind,precision,checkpointed", [("llama", "fp32", True), ("llama", "bf16", False),
                                                         ("qwen2", "bf16", False)])
def test_hf_rotaries_become_one_fused_pair_per_q_and_k_per_layer_with_the_same_loss_and_gradients(
        kind, precision, checkpointed) -> None:
    """Every apply_rotary_pos_emb (q and k, every layer; a checkpointed layer's recomputed copy too)
    -> fxspeed.rotary_fwd, its backward -> rotary_bwd; no rotary op is left; the step's loss and
    every gradient are those of the unfused program, bit for bit. bf16: every fused op reads q/k or
    their gradient in bf16, and the casts to bf16 after them are folded in (they write bf16), except
    Qwen2's backward: its q/k biases' gradients read the rotary's gradient in fp32 too."""
    layers = 2
    model, batch = tiny_hf(kind, layers=layers), hf_batches(1)[0]
    if checkpointed:
        model.gradient_checkpointing_enable()
        model.train()
    step = compile_step(model, (), batch, config=fxspeed.Config(precision=precision, disable_passes=UNFUSED),
                        loss_fn=None)
    gm = step.captured.gm
    inputs = step_inputs(step, model, (), batch)
    plain = run_step(gm, inputs)
    before = count_targets(gm)
    regions = before["aten.neg.default"]  # one neg per rotary, forward or backward, and no other neg
    module_of = dict(step.captured.module_of)
    assert fuse_rotary(gm.graph, module_of) == regions
    gm.graph.lint()
    gm.recompile()
    after = count_targets(gm)
    assert not find_rotaries(gm.graph)
    assert "aten.neg.default" not in after and "aten.slice_backward.default" not in after
    fused_nodes = [n for n in gm.graph.nodes if str(n.target) in (FWD, BWD)]
    assert all("stack_trace" in n.meta and "nn_module_stack" in n.meta for n in fused_nodes)  # the add's, inherited
    assert after[BWD] == 2 * layers and after[FWD] == regions - 2 * layers >= 2 * layers, after
    backwards_fp32 = 2 * layers if kind == "qwen2" else 0  # their results, read by the bias gradients' sums
    assert low_and_fp32_rotary_tensors(gm) == ((2 * regions - backwards_fp32, backwards_fp32) if precision == "bf16"
                                               else (0, 2 * regions))
    fused = run_step(gm, inputs)
    names = ["loss", *(s.target for s in step.captured.signature.outputs[1:])]
    for name, a, b in zip(names, fused, plain, strict=True):
        identical(a, b, name)


def test_a_bf16_training_run_with_fused_rotary_equals_the_same_run_without_it(rotary_fused, monkeypatch) -> None:
    """Three AdamW steps of HF Llama in bf16 through fxspeed.compile, fuse_kernels on: the losses
    and updated parameters equal, bit for bit, those of the same pipeline with every rotary left
    unfused (`rewrite` refusing); the fused ops ran, each step, for q and k, forward and backward."""
    model, batches = tiny_hf("llama", layers=1), hf_batches()
    config = fxspeed.Config(precision="bf16", optimizer="adamw", lr=1e-3)
    plain_model = copy.deepcopy(model)
    calls = []
    inner = rotary._rotary
    monkeypatch.setattr(rotary, "_rotary", lambda *a, **k: calls.append((k["backward"], a[3])) or inner(*a, **k))
    _, losses = fxspeed_train(model, batches, config)
    assert calls.count((True, torch.bfloat16)) == 2 * len(batches), calls  # q's and k's gradients, cast folded
    assert calls.count((False, torch.bfloat16)) >= 2 * len(batches), calls  # (recompute_pointwise may run it again)
    monkeypatch.setattr(rotary_pattern, "rewrite", lambda graph, mt, module_of: False)
    _, plain_losses = fxspeed_train(plain_model, batches, config)
    assert losses == plain_losses
    for (name, p), q in zip(model.named_parameters(), plain_model.parameters()):
        identical(p.detach(), q.detach(), name)


# --- hand-written rotaries: the matched form and its near misses ---------------------------------

def rotate(x: torch.Tensor, form: str) -> torch.Tensor:
    """rotate_half (form "hf"), or a near miss of it."""
    d = x.shape[-1]
    h = d // 4 if form == "other_split" else d // 2
    x1, x2 = x[..., :h], x[..., h:]
    if form == "cat_swapped":
        return torch.cat((x1, -x2), dim=-1)
    if form == "inverse":  # rotate_half's transpose (the other direction)
        return torch.cat((x2, -x1), dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryNet(nn.Module):
    """q = linear(x) as [B, H, S, D] (HF's transpose), then a rotary `form` with cos/sin buffers of
    `cos_shape`, then a linear and the mean square. `low`: q in bf16 (a bf16 matmul's output);
    `cast_after`: its result cast to bf16 (as before a bf16 attention)."""

    def __init__(self, heads: int, d: int, seq: int, form: str, low: bool, cast_after: bool, cos_shape: str) -> None:
        super().__init__()
        self.heads, self.d, self.form, self.low, self.cast_after = heads, d, form, low, cast_after
        self.q, self.o = nn.Linear(8, heads * d), nn.Linear(heads * d, 4)
        rd = d // 2 if form == "partial" else d  # partial rotary: the first half of the head dim rotates
        inv = 1.0 / 10000 ** (torch.arange(0, rd, 2).float() / rd)
        angles = torch.arange(seq).float()[:, None] * inv
        emb = torch.cat((angles, angles), dim=-1)
        shape = {"[S, D]": (seq, rd), "[1, 1, S, D]": (1, 1, seq, rd), "[B, 1, S, D]": (2, 1, seq, rd)}[cos_shape]
        self.register_buffer("cos", emb.cos().expand(shape).contiguous())
        self.register_buffer("sin", emb.sin().expand(shape).contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.heads, self.d).transpose(1, 2)
        if self.low:
            q = q.to(torch.bfloat16)
        cos, sin = self.cos, self.sin
        if self.form == "cos_cast_to_x":  # HF's own code: in bf16 the whole region is bf16 math
            cos, sin = cos.to(q.dtype), sin.to(q.dtype)
        extra = 0.0
        if self.form == "partial":
            qr = q[..., :q.shape[-1] // 2]
            y = torch.cat((qr * cos + rotate(qr, "hf") * sin, q[..., qr.shape[-1]:]), dim=-1)
        elif self.form == "rotate_first":  # autograd then sums x's gradient in another order
            turned = rotate(q, "hf")
            y = q * cos + turned * sin
        else:
            qc = q * cos  # HF's order of evaluation: q * cos, then rotate_half(q)
            turned = rotate(q, self.form)
            y = qc + turned * sin
            if self.form == "extra_reader":
                extra = turned.float().pow(2).mean()
        if self.cast_after:
            y = y.to(torch.bfloat16)
        out = self.o(y.float().transpose(1, 2).reshape(b, s, -1))
        return out.pow(2).mean() + extra


FORMS = ("hf", "partial", "cos_cast_to_x", "rotate_first", "other_split", "cat_swapped", "inverse", "extra_reader")


def fused_forms(form: str, low: bool) -> tuple[int, int]:
    """(forwards, backwards) the matcher fuses in a RotaryNet. `low`: the model's own cast makes
    autograd round the gradient of rotate_half(q) (a bf16 value) to bf16: a backward in bf16 math."""
    if form in ("hf", "partial") or (form == "cos_cast_to_x" and not low):
        return 1, 0 if low else 1
    # rotate_first: the forward is HF's; x's gradient is summed (g cos + u) + v, not (u + v) + g cos
    return (1, 0) if form == "rotate_first" else (0, 0)


@pytest.mark.parametrize("form", FORMS)
@settings(max_examples=2, deadline=None, derandomize=True)
@given(low=st.booleans(), cast_after=st.booleans(),
       cos_shape=st.sampled_from(["[S, D]", "[1, 1, S, D]", "[B, 1, S, D]"]), heads=st.sampled_from([1, 2]),
       d=st.sampled_from([4, 8]), seq=st.sampled_from([3, 5]))
def test_hand_written_rotaries_are_fused_exactly_when_they_are_hf_s_and_compute_the_same(
        form, low, cast_after, cos_shape, heads, d, seq) -> None:
    """Random small nets: the matched forms (HF's, partial rotary, HF's cos.to(x.dtype) when that
    is a no-op) become one fused forward and one fused backward (rotate_half evaluated first: the
    forward only); the near misses (another split, the cat's operands swapped, the other direction,
    the rotated half read elsewhere, a region in bf16 math) leave the graph as it was; loss and
    gradients are the unfused program's, bit for bit."""
    torch.manual_seed(0)
    model = RotaryNet(heads, d, seq, form, low, cast_after, cos_shape)
    x = torch.randn(2, seq, 8)
    step = compile_step(model, (x,), {}, config=fxspeed.Config(disable_passes=UNFUSED), loss_fn=None)
    gm = step.captured.gm
    inputs = step_inputs(step, model, (x,), {})
    plain = run_step(gm, inputs)
    before = count_targets(gm)
    fused_regions = fuse_rotary(gm.graph, dict(step.captured.module_of))
    gm.recompile()
    after = count_targets(gm)
    forwards, backwards = fused_forms(form, low)
    if forwards:
        assert fused_regions == forwards + backwards and (after.get(FWD), after.get(BWD, 0)) == (1, backwards), after
        assert after.get("aten.neg.default", 0) == before["aten.neg.default"] - forwards - backwards
        fwd = next(n for n in gm.graph.nodes if str(n.target) == FWD)
        # the cast folded, unless a cat with q's other half is between (partial rotary)
        assert fwd.meta["val"].dtype == (torch.bfloat16 if cast_after and form != "partial" else torch.float32)
    else:
        assert fused_regions == 0 and after == before, "a form that is not matched was rewritten"
    names = ["loss", *(s.target for s in step.captured.signature.outputs[1:])]
    for name, a, b in zip(names, run_step(gm, inputs), plain, strict=True):
        identical(a, b, name)
    if INTERPRETING and forwards and triton_available():  # in the interpreted run, the Triton kernel computed them
        assert rotary._make_kernel.cache_info().currsize == 1


def rotary_backward_ops(g: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, gc_first: bool) -> torch.Tensor:
    """The ATen ops autograd records for x's gradient through HF's rotary (`gc_first`: the last
    add's operands swapped, so the sum takes g's layout instead of slice_backward's contiguous one)."""
    aten = torch.ops.aten
    shape, d = list(g.shape), g.shape[-1]
    gs = aten.mul.Tensor(g, sin)
    n = aten.neg.default(aten.slice.Tensor(gs, 3, 0, d // 2))
    u = aten.slice_backward.default(n, shape, 3, d // 2, sys.maxsize, 1)
    v = aten.slice_backward.default(aten.slice.Tensor(gs, 3, d // 2, d), shape, 3, 0, d // 2, 1)
    w, gc = aten.add.Tensor(u, v), aten.mul.Tensor(g, cos)
    return aten.add.Tensor(gc, w) if gc_first else aten.add.Tensor(w, gc)


@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
@pytest.mark.parametrize("gc_first", [False, True])
def test_a_rewrite_whose_result_would_have_another_layout_leaves_the_graph_as_it_was(layout, gc_first) -> None:
    """The backward's form with its last add swapped matches, but its sum then has g's strides:
    rewritten when those are the fused op's (contiguous g), left as it was when not (HF's
    transposed g), where readers of the sum (views) could depend on them."""
    from torch.fx.experimental.proxy_tensor import make_fx

    x, cos, sin = rotary_inputs(2, 3, 4, 8, torch.float32, torch.float32, layout, "[1, 1, S, D]")
    gm = make_fx(lambda g, c, s: rotary_backward_ops(g, c, s, gc_first), tracing_mode="fake")(x, cos, sin)
    code = gm.code
    dx = next(n for n in reversed(gm.graph.nodes) if n.target is torch.ops.aten.add.Tensor)
    module_of = {dx.name: "model.layers.0.self_attn"}
    rewritten = fuse_rotary(gm.graph, module_of)
    gm.recompile()
    if gc_first and layout == "transposed":
        assert rewritten == 0 and gm.code == code
    else:
        fused = next(n for n in gm.graph.nodes if str(n.target) == BWD)
        assert rewritten == 1 and module_of.get(fused.name) == "model.layers.0.self_attn", gm.code
    identical(gm(x, cos, sin), rotary_backward_ops(x, cos, sin, gc_first), "gradient")


# --- the cuda tier -------------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the cuda tier needs a CUDA device")
@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("shape,layout", [((1, 1, 1, 2), "contiguous"), ((2, 32, 2048, 128), "transposed"),
                                          ((4, 8, 4096, 64), "contiguous"), ((3, 5, 77, 96), "transposed")])
def test_the_compiled_rotary_kernel_computes_the_unfused_ops_bit_for_bit_on_cuda(shape, layout, dtype) -> None:
    """Compiled (fp fusion off: no FMA contracts the products and the sum), the kernel gives the
    unfused ops' values exactly, forward and backward, in fp32 and cast to bf16."""
    pytest.importorskip("triton")
    if INTERPRETING:
        pytest.skip("TRITON_INTERPRET=1: this test checks the compiled kernel")
    dt = DTYPES[dtype]
    x, cos, sin = (t.cuda() for t in rotary_inputs(*shape, dt, torch.float32, layout, "[1, 1, S, D]"))
    g = torch.randn(shape, device="cuda").to(dt)
    assert rotary.use_triton(x, cos, sin)
    xf = x.float().requires_grad_()
    ref = unfused(xf, cos, sin)
    (ref_dx,) = torch.autograd.grad(ref, xf, g.float())
    for out_dtype in (None, torch.bfloat16):
        want = out_dtype or torch.float32
        y = rotary.rotary_fwd(x, cos, sin, out_dtype)
        identical(y, ref.detach().to(want), f"forward -> {want}")
        assert same_strides(y, ref)
        identical(rotary.rotary_bwd(g, cos, sin, out_dtype), ref_dx.to(want), f"backward -> {want}")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the cuda tier needs a CUDA device")
def test_on_cuda_hf_llama_s_rotaries_are_fused_and_give_the_unfused_program_s_loss_and_gradients() -> None:
    pytest.importorskip("triton")
    if INTERPRETING:
        pytest.skip("TRITON_INTERPRET=1: this test checks the compiled kernel")
    model = tiny_hf("llama", layers=2).cuda()
    batch = {k: v.cuda() for k, v in hf_batches(1)[0].items()}
    for precision, rtol in (("fp32", 1e-5), ("bf16", 1e-2)):
        step = compile_step(model, (), batch, config=fxspeed.Config(precision=precision, disable_passes=UNFUSED),
                            loss_fn=None)
        inputs = step_inputs(step, model, (), batch)
        plain = run_step(step.captured.gm, inputs)
        assert fuse_rotary(step.captured.gm.graph, dict(step.captured.module_of)) == 4 + 4
        step.captured.gm.recompile()
        for i, (a, b) in enumerate(zip(run_step(step.captured.gm, inputs), plain, strict=True)):
            assert_close_rel(a, b, f"{precision} output {i}", rtol)
