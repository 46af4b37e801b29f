"""fold_norm_casts (passes/graph/fold_norm_casts.py): the cast to bf16/fp16 after a fused norm is
folded into the norm op (`out_dtype`, runtime/kernels/norms.py and residual_norms.py).

The kernels (out_dtype against the same op without it, then `.to`) run in a child pytest started
with TRITON_INTERPRET=1 (`test_the_kernels_with_out_dtype_run_under_triton_s_interpreter`); the
graph tests run the ops' torch fallback (and, in the interpreted run, one model runs the kernels).
The `cuda` test at the bottom checks the compiled kernels.
"""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn as nn
from conftest import INTERPRETING, needs_interpreter, run_interpreted
from hypothesis import given, settings
from hypothesis import strategies as st
from test_fusion_kernels import close, count_targets, hf_batches, run_step, step_inputs, tiny_hf

import fxspeed
from fxspeed.compiler.pipelines import compile_step
from fxspeed.passes.graph.fold_norm_casts import fold_norm_casts_in
from fxspeed.runtime.kernels import norms, residual_norms

aten = torch.ops.aten
ops = torch.ops.fxspeed
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
NORM_FWDS = {ops.layer_norm_fwd.default: 0, ops.rms_norm_fwd.default: 0, ops.add_layer_norm_fwd.default: 1,
             ops.add_rms_norm_fwd.default: 1}  # op -> the index of its normalized output
CASTS = (aten._to_copy.default, torch.ops.prims.convert_element_type.default)

INTERPRETED_TESTS = ("test_a_norm_op_with_out_dtype_returns_its_output_converted_and_the_rest_unchanged",
                     "test_folding_keeps_a_bf16_llama_step_bit_identical_when_the_kernels_run")


def test_the_kernels_with_out_dtype_run_under_triton_s_interpreter() -> None:
    """Runs INTERPRETED_TESTS in a child pytest that sets TRITON_INTERPRET=1 from the start."""
    run_interpreted(__file__, INTERPRETED_TESTS)


# --- the ops ------------------------------------------------------------------------------------

def call_op(kind: str, x, r, w, b, out_dtype=None) -> tuple[torch.Tensor, ...]:
    n = [x.shape[-1]]
    extra = (out_dtype,) if out_dtype is not None else ()
    if kind == "layer":
        return ops.layer_norm_fwd(x, n, w, b, 1e-5, *extra)
    if kind == "rms":
        return ops.rms_norm_fwd(x, n, w, 1e-6, *extra)
    if kind == "add_layer":
        return ops.add_layer_norm_fwd(x, r, n, w, b, 1e-5, *extra)
    return ops.add_rms_norm_fwd(x, r, n, w, None, *extra)


def assert_out_dtype_is_a_cast(kind: str, args: tuple, low: torch.dtype) -> tuple[torch.Tensor, ...]:
    """op(..., out_dtype=low): its y is bit for bit op(...)'s y.to(low); every other output equal."""
    at = 1 if kind.startswith("add") else 0
    base, folded = call_op(kind, *args), call_op(kind, *args, out_dtype=low)
    assert len(base) == len(folded)
    for i, (a, f) in enumerate(zip(base, folded)):
        want = a.to(low) if i == at else a
        assert f.dtype == want.dtype and f.shape == want.shape, (kind, i, f.dtype, want.dtype)
        assert torch.equal(f, want), (kind, i, (f.float() - want.float()).abs().max())
    return folded


@settings(max_examples=12, deadline=None, derandomize=True)
@given(shape=st.tuples(st.integers(1, 8), st.integers(1, 80)),
       kind=st.sampled_from(["layer", "rms", "add_layer", "add_rms"]),
       low=st.sampled_from(["bf16", "fp16"]), inp=st.sampled_from(["fp32", "bf16"]), low_residual=st.booleans())
def test_a_norm_op_with_out_dtype_returns_its_output_converted_and_the_rest_unchanged(shape, kind, low, inp,
                                                                                      low_residual) -> None:
    """Kernel (interpreted) and torch fallback alike: out_dtype gives exactly `y.to(out_dtype)`, one
    rounding to nearest even from the fp32 value (the interpreter's truncating bf16 conversion is
    rounded by hand); the kernel's folded y equals the fallback's up to the norms' fp32 summation
    order (as without out_dtype), and bit for bit where both round the same fp32 value."""
    needs_interpreter()
    m, n = shape
    dt, lo = DTYPES[inp], DTYPES[low]
    torch.manual_seed(m * 1000 + n)
    x = torch.randn(m, n, dtype=dt) * 3 + 1
    r = torch.randn(m, n, dtype=torch.bfloat16 if low_residual else dt)  # bf16 sublayer + fp32 stream
    w, b = torch.randn(n, dtype=dt), torch.randn(n, dtype=dt)
    args = (x, r, w, b)
    assert norms.use_triton(x, w, b)
    kernel = assert_out_dtype_is_a_cast(kind, args, lo)
    with pytest.MonkeyPatch.context() as mp:  # the torch fallback
        mp.setattr(norms, "use_triton", lambda *t: False)
        mp.setattr(residual_norms, "use_triton", lambda *t: False)
        fallback = assert_out_dtype_is_a_cast(kind, args, lo)
    at = 1 if kind.startswith("add") else 0
    if inp == "fp32":  # the fp32 values differ in their last bits: one ulp of the low dtype at most
        ky, fy = kernel[at].double(), fallback[at].double()
        ulp = {torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}[lo]
        assert ((ky - fy).abs() <= ulp * fy.abs().clamp_min(1e-3) + 1e-3).all()
    else:  # bf16 in, bf16 h (the interpreter's conversions of h truncate): the kernel tests' tolerance
        close(kernel[at], fallback[at], "y", "bf16")


# --- the pass on small graphs ---------------------------------------------------------------------

def trace(f, *args) -> torch.fx.GraphModule:
    from torch.fx.experimental.proxy_tensor import make_fx
    return make_fx(f, tracing_mode="fake")(*args)


def _ln(x, w, b):
    return ops.layer_norm_fwd(x, [x.shape[-1]], w, b, 1e-5)


GRAPHS = {
    # name: (function of (x, r, w, b), (norm ops folded, casts removed))
    "only_casts": (lambda x, r, w, b: _ln(x, w, b)[0].to(torch.bfloat16) * 2, (1, 1)),
    "two_casts_one_dtype": (lambda x, r, w, b: (lambda y: (y.to(torch.float16) + 1,
                                                           torch.ops.prims.convert_element_type(y, torch.float16)))(
        _ln(x, w, b)[0]), (1, 2)),
    "add_rms_keeps_h": (lambda x, r, w, b: (lambda f: (f[0] * 3, f[1].to(torch.bfloat16), f[2]))(
        ops.add_rms_norm_fwd(x, r, [x.shape[-1]], w, 1e-6)), (1, 1)),
    "read_in_fp32_too": (lambda x, r, w, b: (lambda y: (y.to(torch.bfloat16), y + r))(_ln(x, w, b)[0]), (0, 0)),
    "a_view_before_the_cast": (lambda x, r, w, b: _ln(x, w, b)[0].view(-1).to(torch.bfloat16), (0, 0)),
    "two_low_dtypes": (lambda x, r, w, b: (lambda y: (y.to(torch.bfloat16), y.to(torch.float16)))(_ln(x, w, b)[0]),
                       (0, 0)),
    "cast_to_fp64": (lambda x, r, w, b: _ln(x, w, b)[0].to(torch.float64), (0, 0)),
    "y_is_an_output": (lambda x, r, w, b: (lambda y: (y, y.to(torch.bfloat16)))(_ln(x, w, b)[0]), (0, 0)),
    "bf16_output": (lambda x, r, w, b: ops.rms_norm_fwd(x.bfloat16(), [x.shape[-1]], None, None)[0].to(torch.float16),
                    (0, 0)),
}


@pytest.mark.parametrize("name", sorted(GRAPHS))
def test_a_norm_whose_output_is_read_only_by_casts_to_one_low_dtype_is_folded_and_no_other(name) -> None:
    """Small traced graphs: folded exactly when every reader of the fp32 y is a cast of y to one
    low dtype (an fp32 reader, a view first, two low dtypes, a cast to fp64, y returned, a bf16 y:
    left alone); the folded graph computes the same values bit for bit."""
    f, (want_ops, want_casts) = GRAPHS[name]
    torch.manual_seed(0)
    args = (torch.randn(2, 3, 16), torch.randn(2, 3, 16), torch.randn(16), torch.randn(16))
    gm = trace(f, *args)
    before = count_targets(gm)
    expected = gm(*args)
    folded = fold_norm_casts_in(gm.graph)
    gm.graph.lint()
    gm.recompile()
    after = count_targets(gm)
    casts = sum(before.get(str(c), 0) - after.get(str(c), 0) for c in CASTS)
    assert (folded, casts) == (want_ops, want_casts), (name, before, after)
    assert len(folded_ops(gm)) == want_ops
    for n in folded_ops(gm):
        assert all(g.meta["val"].dtype == n.args[-1] for g in n.users if g.args[1] == NORM_FWDS[n.target])
    for a, b in zip(gm(*args), expected, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b), name


# --- the pass in compile_step -------------------------------------------------------------------

def tiny_gpt2(layers: int = 1) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=layers, n_head=4,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                  eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


def model_of(kind: str) -> nn.Module:
    torch.manual_seed(0)
    return tiny_gpt2() if kind == "gpt2" else tiny_hf(kind, layers=1)


def compiled(model: nn.Module, batch: dict, precision: str, disable: tuple[str, ...] = ()):
    return compile_step(model, (), batch, config=fxspeed.Config(precision=precision, disable_passes=disable),
                        loss_fn=None)


def folded_ops(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.target in NORM_FWDS and n.args[-1] in (torch.bfloat16, torch.float16)]


def casts_after_norms(gm: torch.fx.GraphModule) -> int:
    return sum(1 for n in gm.graph.nodes if n.target in CASTS and n.args[0].target is operator.getitem
               and n.args[0].args[0].target in NORM_FWDS)


def check_bf16_model(kind: str) -> int:
    """Compiled with and without the pass: the casts after the norms are gone, the norms carry
    out_dtype=bf16, and loss and every gradient are bit for bit the same. Returns the casts removed."""
    model, batch = model_of(kind), hf_batches(1)[0]
    step, plain = compiled(model, batch, "bf16"), compiled(model, batch, "bf16", ("fold_norm_casts",))
    assert any(r.name == "fold_norm_casts" and r.modified for r in step.records)
    gm, ref = step.captured.gm, plain.captured.gm
    removed = casts_after_norms(ref)
    assert removed >= 2 and casts_after_norms(gm) == 0, (removed, casts_after_norms(gm))
    assert len(folded_ops(gm)) == removed and all(n.args[-1] == torch.bfloat16 for n in folded_ops(gm))
    cast_count = lambda g: sum(count_targets(g).get(str(c), 0) for c in CASTS)  # noqa: E731
    assert cast_count(ref) - cast_count(gm) == removed
    for n in folded_ops(gm):
        for g in n.users:
            if g.args[1] == NORM_FWDS[n.target]:
                assert g.meta["val"].dtype == torch.bfloat16
    out = run_step(gm, step_inputs(step, model, (), batch))
    ref_out = run_step(ref, step_inputs(plain, model, (), batch))
    names = ["loss", *(s.target for s in step.captured.signature.outputs[1:])]
    for name, a, b in zip(names, out, ref_out, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    return removed


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_in_a_bf16_hf_model_the_casts_after_the_norms_fold_into_them_and_the_step_is_bit_identical(
        monkeypatch, kind) -> None:
    monkeypatch.setenv("FXSPEED_FUSE_ON_CPU", "1")
    check_bf16_model(kind)


def test_folding_keeps_a_bf16_llama_step_bit_identical_when_the_kernels_run(monkeypatch) -> None:
    """The same check where the fused ops run the Triton kernels (interpreted): the folded norms
    store bf16 themselves, rounded as the cast rounded."""
    needs_interpreter()
    monkeypatch.setenv("FXSPEED_FUSE_ON_CPU", "1")
    check_bf16_model("llama")


class TwoNorms(nn.Module):
    """`near`'s output is read by the next linear only (folded); `far`'s by a linear and, in fp32,
    by the residual add (left alone)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.near, self.b = nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 32)
        self.far, self.c = nn.LayerNorm(32), nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.b(self.near(self.a(x)))
        y = self.far(h)
        return (self.c(y) + y).pow(2).mean()


def test_a_norm_whose_output_is_also_read_in_fp32_keeps_its_cast(monkeypatch) -> None:
    monkeypatch.setenv("FXSPEED_FUSE_ON_CPU", "1")
    torch.manual_seed(0)
    model, x = TwoNorms(), torch.randn(4, 16)
    step = compile_step(model, (x,), {}, config=fxspeed.Config(precision="bf16"), loss_fn=None)
    plain = compile_step(model, (x,), {}, config=fxspeed.Config(precision="bf16", disable_passes=("fold_norm_casts",)),
                         loss_fn=None)
    gm = step.captured.gm
    forward = [n for n in gm.graph.nodes if n.target in NORM_FWDS and "recomputed_pointwise" not in n.meta]
    assert [n.target for n in forward] == [ops.layer_norm_fwd.default] * 2  # near, far (graph order)
    near, far = forward
    assert near.args[-1] == torch.bfloat16 and len(far.args) == 5, (near.format_node(), far.format_node())
    readers = [u for g in far.users if g.args[1] == 0 for u in g.users]
    assert any(u.target in CASTS for u in readers) and any(u.target not in CASTS for u in readers)
    out = run_step(gm, step_inputs(step, model, (x,), {}))
    for a, b in zip(out, run_step(plain.captured.gm, step_inputs(plain, model, (x,), {})), strict=True):
        assert torch.equal(a, b)


def test_in_an_fp32_program_nothing_is_folded(monkeypatch) -> None:
    monkeypatch.setenv("FXSPEED_FUSE_ON_CPU", "1")
    model, batch = model_of("llama"), hf_batches(1)[0]
    step, plain = compiled(model, batch, "fp32"), compiled(model, batch, "fp32", ("fold_norm_casts",))
    assert [(r.name, r.modified) for r in step.records if r.name == "fold_norm_casts"] == [("fold_norm_casts", False)]
    assert not folded_ops(step.captured.gm)
    assert count_targets(step.captured.gm) == count_targets(plain.captured.gm)
    assert [n.format_node() for n in step.captured.gm.graph.nodes] == \
        [n.format_node() for n in plain.captured.gm.graph.nodes]


# --- the cuda tier ----------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the cuda tier needs a CUDA device")
@pytest.mark.parametrize("kind", ["layer", "rms", "add_layer", "add_rms"])
@pytest.mark.parametrize("low", ["bf16", "fp16"])
@pytest.mark.parametrize("shape", [(1, 1), (37, 300), (512, 768), (64, 8192)])
def test_the_compiled_kernels_with_out_dtype_store_the_rounded_output(shape, low, kind) -> None:
    """On CUDA: out_dtype gives exactly the op's fp32 output `.to(out_dtype)` (bf16 and fp16
    inputs: converted after), and the folded y is torch's norm rounded the same way up to one ulp."""
    pytest.importorskip("triton")
    if INTERPRETING:
        pytest.skip("TRITON_INTERPRET=1: this test checks the compiled kernels")
    m, n = shape
    lo, dev = DTYPES[low], torch.device("cuda")
    for dt in (torch.float32, torch.bfloat16):
        x = torch.randn(m, n, dtype=dt, device=dev) * 3 + 1
        r = torch.randn(m, n, dtype=dt, device=dev)
        w, b = torch.randn(n, dtype=dt, device=dev), torch.randn(n, dtype=dt, device=dev)
        assert norms.use_triton(x, w, b)
        folded = assert_out_dtype_is_a_cast(kind, (x, r, w, b), lo)
        h = x + r if kind.startswith("add") else x
        ref = (aten.native_layer_norm.default(h, [n], w, b, 1e-5)[0] if kind.endswith("layer")
               else aten._fused_rms_norm.default(h, [n], w, 1e-6 if kind == "rms" else None)[0]).to(lo)
        y = folded[1 if kind.startswith("add") else 0]
        # one ulp of the low dtype from fp32; from a bf16 input (y computed in bf16, as torch's): two bf16 ulps
        ulp = {torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}[lo] if dt == torch.float32 else 2.0 ** -6
        assert ((y.double() - ref.double()).abs() <= ulp * ref.double().abs().clamp_min(1e-3) + 1e-3).all(), (dt, kind)
