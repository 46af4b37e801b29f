"""Residual add + norm (runtime/kernels/residual_norms.py, passes/graph/residual_norm_pattern.py).

Kernels against torch under Triton's interpreter in a child pytest (TRITON_INTERPRET=1 must be
set before triton is first imported: see tests/test_fusion_kernels.py), the matcher on fxspeed's
GPT and HF Llama (fp32, bf16), with activation checkpointing, and on small nets of near-miss
forms; training through fxspeed.compile, where the fuse_residual_norms pass runs the matcher after
recompute_pointwise (`wire` counts its regions, or moves it to the end of fuse_kernels, the place
it was measured against: see `test_wired_after_recompute_pointwise_...`).
Outside the interpreted run the ops run their torch fallback, which is the unfused ops
themselves, so the graph tests' fused and unfused programs agree bit for bit there.
"""

from __future__ import annotations

import copy
import importlib.util
import operator

import pytest
import torch
import torch.nn as nn
from conftest import INTERPRETING, assert_close_rel, check_parity, run_interpreted
from hypothesis import given, settings
from hypothesis import strategies as st
from test_fusion_kernels import (DTYPES, UNFUSED, close, count_targets, fuse_in_place, grad_scales, run_step,
                                 step_inputs, tiny_hf)

import fxspeed
import fxspeed.passes.graph.fuse_kernels as fuse_kernels_module
import fxspeed.passes.graph.fuse_residual_norms as fuse_residual_norms_pass
from fxspeed.compiler.pass_manager import PassResult, graph_pass
from fxspeed.compiler.pipelines import compile_step
from fxspeed.models import GPT, GPTConfig
from fxspeed.passes.graph.residual_norm_pattern import fuse_residual_norms
from fxspeed.runtime.kernels import norms, residual_norms

INTERPRETED_TESTS = ("test_add_layer_norm_kernels_return_the_sum_and_what_native_layer_norm_and_its_backward_return",
                     "test_add_rms_norm_kernels_return_the_sum_and_what_fused_rms_norm_and_its_backward_return",
                     "test_a_gpt_trained_with_residual_norms_fused_matches_eager[after_recompute_pointwise]")

aten = torch.ops.aten
FWD = {"layer": "fxspeed.add_layer_norm_fwd.default", "rms": "fxspeed.add_rms_norm_fwd.default"}
BWD = {"layer": "fxspeed.layer_norm_bwd_add.default", "rms": "fxspeed.rms_norm_bwd_add.default"}
NORM_FWD = {"layer": "fxspeed.layer_norm_fwd.default", "rms": "fxspeed.rms_norm_fwd.default"}


# the kernel tests run only there (they need the interpreter set before triton's first import)
interpreted = pytest.mark.skipif(not INTERPRETING, reason="runs in a child process with TRITON_INTERPRET=1 "
                                 "(test_the_kernels_match_torch_under_triton_s_interpreter)")
# and the cuda tier only outside it (it checks the compiled kernels)
_CUDA_TIER = (pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="the cuda tier needs a CUDA device"),
              pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton"),
              pytest.mark.skipif(INTERPRETING, reason="TRITON_INTERPRET=1: this test checks the compiled kernels"))


def compiled_on_cuda(test):
    for mark in _CUDA_TIER:
        test = mark(test)
    return test


def test_the_kernels_match_torch_under_triton_s_interpreter() -> None:
    """Runs INTERPRETED_TESTS in a child pytest that sets TRITON_INTERPRET=1 from the start."""
    run_interpreted(__file__, INTERPRETED_TESTS)


# --- kernels ------------------------------------------------------------------------------------

def assert_is_the_sum(h: torch.Tensor, x: torch.Tensor, r: torch.Tensor) -> None:
    """h is aten.add(x, r): bit for bit, except that Triton's interpreter rounds fp32 -> bf16
    toward zero (compiled Triton, like ATen, rounds to nearest even: the cuda test checks bits),
    so an interpreted bf16 h may be one bf16 ulp off."""
    ref = x + r
    assert h.shape == ref.shape and h.dtype == ref.dtype and h.stride() == ref.stride()
    if h.dtype == torch.bfloat16 and INTERPRETING:
        assert ((h.float() - ref.float()).abs() <= ref.float().abs() * 2.0 ** -7).all(), "h off by more than an ulp"
    else:
        assert torch.equal(h, ref), "h is not bit for bit aten.add(x, r)"


rows = st.tuples(st.integers(1, 32), st.integers(1, 300))
dtypes = st.sampled_from(sorted(DTYPES))
# the residual's dtype: the input's, or bf16 added to an fp32 stream (what bf16 programs do)
residual = st.sampled_from(["same", "bf16"])


def check_add_layer_norm(x: torch.Tensor, r: torch.Tensor, w, b, dtype: str) -> None:
    """The kernels (asserted to run) against aten.add, native_layer_norm and its backward."""
    n = x.shape[-1]
    assert residual_norms._fits(x, r, [n], w, b, same_dtype=False)
    h, *got = residual_norms.add_layer_norm_fwd(x, r, [n], w, b, 1e-5)
    assert_is_the_sum(h, x, r)
    ref = aten.native_layer_norm.default(h, [n], w, b, 1e-5)  # the norm of the h the kernel stored
    for name, a, want in zip(("out", "mean", "rstd"), got, ref):
        close(a, want, name, dtype)
    g, gh = torch.randn_like(h), torch.randn_like(h)
    grads = residual_norms.layer_norm_bwd_add(g, h, [n], ref[1], ref[2], w, b, gh)
    dx, dw, db = aten.native_layer_norm_backward.default(g, h, [n], ref[1], ref[2], w, b,
                                                         [True, w is not None, b is not None])
    scales = grad_scales(h, g, ref[2])
    close(grads[0], dx.float().add(gh.float()).to(h.dtype), "grad_input + grad_h", dtype, scales["grad_input"] + 1)
    for name, a, want in zip(("grad_weight", "grad_bias"), grads[1:], (dw, db)):
        if want is None:
            assert a.numel() == 0, f"{name}: an absent parameter's gradient is an empty tensor"
        else:
            close(a, want, name, dtype, scales[name])


def check_add_rms_norm(x: torch.Tensor, r: torch.Tensor, w, eps, dtype: str) -> None:
    """The kernels (asserted to run) against aten.add, aten._fused_rms_norm and autograd through it."""
    n = x.shape[-1]
    assert residual_norms._fits(x, r, [n], w, same_dtype=False)
    h, out, rstd = residual_norms.add_rms_norm_fwd(x, r, [n], w, eps)
    assert_is_the_sum(h, x, r)
    hr, wr = h.clone().requires_grad_(), w.clone().requires_grad_() if w is not None else None
    ref, ref_rstd = aten._fused_rms_norm.default(hr, [n], wr, eps)  # a composite on CPU: autograd runs through it
    close(out, ref.detach(), "out", dtype)
    close(rstd, ref_rstd.detach(), "rstd", dtype)
    g, gh = torch.randn_like(h), torch.randn_like(h)
    dh, dw = residual_norms.rms_norm_bwd_add(g, h, [n], ref_rstd.detach(), w, gh)
    ref_grads = torch.autograd.grad(ref, [hr, *([wr] if w is not None else [])], g)
    close(dh, ref_grads[0].float().add(gh.float()).to(h.dtype), "grad_input + grad_h", dtype,
          float(g.abs().max()) * float(ref_rstd.detach().max()) + 1)
    if w is not None:
        close(dw, ref_grads[1], "grad_weight", dtype)
    else:
        assert dw.numel() == 0


def residual_of(x: torch.Tensor, res: str) -> torch.Tensor:
    """r: of x's dtype, or bf16 added to an fp32 x (a bf16 program's sublayer output)."""
    return torch.randn_like(x, dtype=torch.bfloat16 if res == "bf16" and x.dtype == torch.float32 else x.dtype)


def affine_params(n: int, dtype: torch.dtype, affine: str, device: str = "cpu") -> tuple:
    """(weight, bias) for `affine` "weight+bias" | "weight" | "none"."""
    return tuple(torch.randn(n, dtype=dtype, device=device) if affine in kinds else None
                 for kinds in (("weight+bias", "weight"), ("weight+bias",)))


@interpreted
@settings(max_examples=6, deadline=None)
@given(shape=rows, dtype=dtypes, affine=st.sampled_from(["weight+bias", "weight", "none"]),
       lead=st.sampled_from([(), (2,)]), res=residual)
def test_add_layer_norm_kernels_return_the_sum_and_what_native_layer_norm_and_its_backward_return(
        shape, dtype, affine, lead, res) -> None:
    x = torch.randn(*lead, *shape, dtype=DTYPES[dtype]) * 3 + 1
    check_add_layer_norm(x, residual_of(x, res), *affine_params(shape[1], x.dtype, affine), dtype)


@interpreted
@settings(max_examples=6, deadline=None)
@given(shape=rows, dtype=dtypes, affine=st.sampled_from(["weight", "none"]), eps=st.sampled_from([None, 1e-6]),
       res=residual)
def test_add_rms_norm_kernels_return_the_sum_and_what_fused_rms_norm_and_its_backward_return(
        shape, dtype, affine, eps, res) -> None:
    x = torch.randn(*shape, dtype=DTYPES[dtype]) * 2
    check_add_rms_norm(x, residual_of(x, res), affine_params(shape[1], x.dtype, affine)[0], eps, dtype)


def reference_ops(x, r, w, b, g, gh, n):
    """What the fused ops stand for: fxspeed's norm ops and aten.add (their fallback, literally)."""
    h = x + r
    ln = norms.layer_norm_fwd(h, [n], w, b, 1e-5)
    rms = norms.rms_norm_fwd(h, [n], w, 1e-6)
    lb = norms.layer_norm_bwd(g, h, [n], ln[1], ln[2], w, b)
    rb = norms.rms_norm_bwd(g, h, [n], rms[1], w)
    return ((h, *ln), (h, *rms), (lb[0] + gh, *lb[1:]), (rb[0] + gh, rb[1])), (ln, rms)


def fused_ops(x, r, w, b, g, gh, n, ln, rms):
    h = x + r
    return (residual_norms.add_layer_norm_fwd(x, r, [n], w, b, 1e-5),
            residual_norms.add_rms_norm_fwd(x, r, [n], w, 1e-6),
            residual_norms.layer_norm_bwd_add(g, h, [n], ln[1], ln[2], w, b, gh),
            residual_norms.rms_norm_bwd_add(g, h, [n], rms[1], w, gh))


@pytest.mark.parametrize("case", ["bf16", "fp32+bf16 residual", "broadcast residual", "transposed"])
def test_the_fake_implementations_give_the_unfused_ops_shapes_dtypes_and_strides(case) -> None:
    """And outside the interpreter (here) the ops are the unfused ops, bit for bit."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    def inputs():
        dt = torch.bfloat16 if case == "bf16" else torch.float32
        x = torch.randn(3, 4, 10, dtype=dt)
        r = {"fp32+bf16 residual": lambda: torch.randn(3, 4, 10, dtype=torch.bfloat16),
             "broadcast residual": lambda: torch.randn(10, dtype=dt),  # the kernels decline these two:
             "transposed": lambda: torch.randn(3, 10, 4, dtype=dt).transpose(1, 2),  # the op is its definition
             }.get(case, lambda: torch.randn_like(x))()
        w, b = torch.randn(10, dtype=dt), torch.randn(10, dtype=dt)
        g, gh = torch.randn(3, 4, 10, dtype=dt), torch.randn(3, 4, 10, dtype=dt)
        return x, r, w, b, g, gh

    def meta(ts):
        return [(t.shape, t.dtype, t.stride()) for group in ts for t in group]

    vals = inputs()
    want, stats = reference_ops(*vals, 10)
    if not INTERPRETING:
        for i, (got_group, want_group) in enumerate(zip(fused_ops(*vals, 10, *stats), want)):
            for a, b in zip(got_group, want_group):
                assert torch.equal(a, b), f"op {i}: the fallback is not the unfused ops"
    with FakeTensorMode():
        fake_vals = inputs()
        fake_want, fake_stats = reference_ops(*fake_vals, 10)
        assert meta(fused_ops(*fake_vals, 10, *fake_stats)) == meta(fake_want) == meta(want)


# --- where the matcher runs ------------------------------------------------------------------------

def wire(monkeypatch, where: str) -> list[int]:
    """Count the regions compile_step fuses, with the matcher where it runs (the fuse_residual_norms
    pass, after recompute_pointwise: "after_recompute_pointwise") or at the end of fuse_kernels
    instead ("after_fuse_kernels", the place it was measured against); returns the list each
    run's count is appended to."""
    counts: list[int] = []

    def counted(graph: torch.fx.Graph, module_of: dict[str, str]) -> int:
        counts.append(fuse_residual_norms(graph, module_of))
        return counts[-1]

    if where == "after_recompute_pointwise":
        monkeypatch.setattr(fuse_residual_norms_pass, "rewrite_residual_norms", counted)
        return counts
    inner = fuse_kernels_module.fuse_kernels

    @graph_pass("fuse_kernels", requires=inner.requires, invalidates=inner.invalidates)
    def wrapped(gm, ctx):
        res = inner(gm, ctx)
        fused = counted(gm.graph, ctx.module_of)
        return PassResult(gm, modified=res.modified or fused > 0)

    monkeypatch.setattr(fuse_kernels_module, "fuse_kernels", wrapped)
    monkeypatch.setattr(fuse_residual_norms_pass, "rewrite_residual_norms", lambda graph, module_of: 0)
    return counts


def launches(gm: torch.fx.GraphModule) -> int:
    """call_function nodes that run something (getitems select, they do not run)."""
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target is not operator.getitem)


def tiny_gpt(layers: int) -> GPT:
    return GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=layers, n_head=2, n_embd=32))


def model_and_batch(kind: str, layers: int) -> tuple[nn.Module, tuple, dict]:
    if kind == "gpt":
        return tiny_gpt(layers), (torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))), {}
    ids = torch.randint(0, 64, (2, 8))
    return tiny_hf("llama", layers=layers), (), {"input_ids": ids, "labels": ids}


def fused_step(model: nn.Module, args: tuple, kwargs: dict, precision: str = "fp32"):
    """The step compiled without fuse_kernels and recompute_pointwise, then fuse_kernels run by
    hand: (step, its inputs, its outputs before the matcher)."""
    step = compile_step(model, args, kwargs, config=fxspeed.Config(precision=precision, disable_passes=UNFUSED),
                        loss_fn=None)
    fuse_in_place(step)
    inputs = step_inputs(step, model, args, kwargs)
    return step, inputs, run_step(step.captured.gm, inputs)


def assert_same_outputs(step, fused: list[torch.Tensor], plain: list[torch.Tensor]) -> None:
    """Loss and every gradient: bit for bit where the ops run their fallback (the unfused ops)."""
    names = ["loss", *(s.target for s in step.captured.signature.outputs[1:])]
    for name, a, b in zip(names, fused, plain, strict=True):
        assert_close_rel(a, b, name, 1e-5 if INTERPRETING else 0.0)


def reads_an_add(gm: torch.fx.GraphModule, targets: set[str]) -> list[str]:
    return [n.name for n in gm.graph.nodes if str(n.target) in targets and isinstance(n.args[0], torch.fx.Node)
            and n.args[0].target is aten.add.Tensor]


# --- the matcher on models ---------------------------------------------------------------------

@pytest.mark.parametrize("kind,norm", [("gpt", "layer"), ("llama", "rms")])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_residual_adds_before_norms_are_fused_in_gpt_and_llama_with_the_same_loss_and_gradients(
        kind, norm, precision) -> None:
    """2 layers: 5 norms, the first reading the embeddings (no residual add yet): 4 fused forwards.
    Backward: the last norm's input gradient has two readers (its h has no residual reader: no
    accumulation), the 4 others are accumulated: 4 fused backwards. bf16 programs add the bf16
    sublayer output to the fp32 residual stream (fp32 + bf16 -> fp32): fused the same."""
    model, args, kwargs = model_and_batch(kind, 2)
    step, inputs, plain = fused_step(model, args, kwargs, precision)
    gm = step.captured.gm
    before, runs_before = count_targets(gm), launches(gm)
    assert len(reads_an_add(gm, {NORM_FWD[norm]})) == 4
    assert fuse_residual_norms(gm.graph, step.captured.module_of) == 8
    gm.graph.lint()
    gm.recompile()
    after = count_targets(gm)
    assert (after.get(FWD[norm], 0), after.get(BWD[norm], 0), after[NORM_FWD[norm]]) == (4, 4, 1), after
    assert reads_an_add(gm, {NORM_FWD[norm], FWD[norm]}) == []
    assert after["aten.add.Tensor"] == before["aten.add.Tensor"] - 8  # 4 residual adds, 4 gradient accumulations
    assert launches(gm) == runs_before - 8
    assert_same_outputs(step, run_step(gm, inputs), plain)


def test_a_checkpointed_layer_s_recomputed_add_and_norm_are_fused_in_backward() -> None:
    """HF gradient checkpointing (1 layer): recompute_checkpointed copies the layer's input norm
    (reading the embeddings) and its residual add + post-attention norm into backward. Forward:
    2 fused (post-attention, final). The copied add + norm: fused in backward (both copies).
    Backward: 2 fused (the post-attention and input norms; the final norm's gradient is not
    accumulated)."""
    model = tiny_hf("llama", layers=1)
    model.gradient_checkpointing_enable()
    model.train()
    ids = torch.randint(0, 64, (2, 8))
    step, inputs, plain = fused_step(model, (), {"input_ids": ids, "labels": ids})
    gm = step.captured.gm
    assert fuse_residual_norms(gm.graph, step.captured.module_of) == 5
    gm.recompile()
    after = count_targets(gm)
    copies = [n for n in gm.graph.nodes if str(n.target) == FWD["rms"] and "recomputed_from" in n.meta]
    assert (after[FWD["rms"]], len(copies), after[BWD["rms"]], after[NORM_FWD["rms"]]) == (3, 1, 2, 2), after
    assert_same_outputs(step, run_step(gm, inputs), plain)


def test_a_norm_recomputed_by_recompute_pointwise_reads_the_fused_sum_and_is_left_alone(monkeypatch) -> None:
    """Run after recompute_pointwise: each norm's forward copy in backward (it recomputes the
    norm's outputs there from h) is not fused with the forward add it reads: that would move
    the add into backward and keep x and r alive until then."""
    monkeypatch.setenv("FXSPEED_FUSE_ON_CPU", "1")
    counts = wire(monkeypatch, "after_recompute_pointwise")
    model, args, kwargs = model_and_batch("gpt", 2)
    gm = compile_step(model, args, kwargs, config=fxspeed.Config(), loss_fn=None).captured.gm
    assert counts == [8]
    c = count_targets(gm)
    copies = [n for n in gm.graph.nodes if str(n.target) == NORM_FWD["layer"] and "recomputed_pointwise" in n.meta]
    assert (c[FWD["layer"]], c[BWD["layer"]]) == (4, 4), c
    # 5 copies: the first norm's reads the embeddings' sum (a broadcast add, then dropout's clone);
    # the 4 others read h = f[0] of their fused forward
    reads = sorted(n.args[0].target.__name__ if n.args[0].target is operator.getitem else str(n.args[0].target)
                   for n in copies)
    assert reads == ["aten.clone.default", *["getitem"] * 4], reads
    assert all(n.args[0].args[0].target is torch.ops.fxspeed.add_layer_norm_fwd.default for n in copies
               if n.args[0].target is operator.getitem)


def test_wired_after_recompute_pointwise_the_fusion_keeps_the_planned_activations(monkeypatch) -> None:
    """The measurement behind where the matcher should run. recompute_pointwise recomputes each
    fxspeed norm forward in backward from h (kept anyway) instead of keeping its output. A fused
    add + norm reads x and r, and r (the sublayer's output) is not kept for backward, so it is not
    recomputed: run inside fuse_kernels (before recompute_pointwise), the plan keeps every fused
    norm's output until backward (GPT fp32: more activations); run after it, the forward fuses
    with the norm's outputs already recomputed in backward, and the activations are unchanged."""
    monkeypatch.setenv("FXSPEED_FUSE_ON_CPU", "1")
    model, _, _ = model_and_batch("gpt", 2)
    batch = (torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16)))

    def activations() -> int:
        return fxspeed.plan(copy.deepcopy(model), 1, fxspeed.Config(), example_inputs=batch).memory(0)["activations"]

    unfused = activations()
    with monkeypatch.context() as m:
        counts = wire(m, "after_fuse_kernels")
        inside = activations()
        assert counts and counts[-1] == 8
    with monkeypatch.context() as m:
        counts = wire(m, "after_recompute_pointwise")
        after = activations()
        assert counts and counts[-1] == 8
    assert after == unfused < inside, (unfused, inside, after)


@pytest.mark.parametrize("where", ["after_fuse_kernels", "after_recompute_pointwise"])
def test_a_gpt_trained_with_residual_norms_fused_matches_eager(monkeypatch, where) -> None:
    """Three SGD steps through fxspeed.compile (why SGD: test_fusion_kernels' transformer test).
    In the interpreted run (two steps there: the interpreter is slow) the Triton kernels train it."""
    monkeypatch.setenv("FXSPEED_FUSE_ON_CPU", "1")
    counts = wire(monkeypatch, where)
    model = tiny_gpt(1)
    batches = [(torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))) for _ in range(2 if INTERPRETING else 3)]
    check_parity(model, batches, fxspeed.Config(optimizer="sgd", lr=0.1), rtol=1e-5)
    assert counts and counts[0] == 4, counts  # 1 layer: 2 fused forwards, 2 fused backwards
    if INTERPRETING and norms.triton_available():
        assert residual_norms._fused_kernels.cache_info().currsize == 1, "the steps ran the Triton kernels"


# --- near misses ------------------------------------------------------------------------------

class ResidualNet(nn.Module):
    """Linear -> a sublayer r -> z = `form` of (h0, r) -> norm(z) -> head; with `stream`, a second
    head reads z too (the residual stream going on: z's gradient is then the norm backward's input
    gradient + the other head's, the accumulation the fused backward takes in)."""

    FORMS = {
        "add": lambda h0, r, v: h0 + r,
        "add_bf16_residual": lambda h0, r, v: h0 + r.to(torch.bfloat16),  # fp32 = fp32 + bf16: fused
        "add_scaled_branch": lambda h0, r, v: h0 + 0.5 * r,  # an exact add of (h0, mul): fused, the mul stays
        "broadcast": lambda h0, r, v: h0 + v,  # [.., n] + [n]
        "alpha": lambda h0, r, v: torch.add(h0, r, alpha=2.0),
        "scaled_sum": lambda h0, r, v: (h0 + r) * 0.5,  # the norm reads a mul
        "sum_of_three": lambda h0, r, v: h0 + r + r.relu(),  # add(add(h0, r), relu): the outer add is exact
    }
    FUSED = {"add", "add_bf16_residual", "add_scaled_branch", "sum_of_three"}

    def __init__(self, n: int, norm: str, form: str, stream: bool) -> None:
        super().__init__()
        self.a, self.f, self.head = nn.Linear(8, n), nn.Linear(n, n), nn.Linear(n, 4)
        self.norm = {"layer": nn.LayerNorm(n), "layer_without_affine": nn.LayerNorm(n, elementwise_affine=False),
                     "rms": nn.RMSNorm(n)}[norm]
        self.v = nn.Parameter(torch.randn(n))
        self.other = nn.Linear(n, 4) if stream else None
        self.form = form

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h0 = self.a(x)
        z = self.FORMS[self.form](h0, self.f(h0.relu()), self.v)
        out = self.head(self.norm(z))
        if self.other is not None:
            out = out + self.other(z).relu()
        return out.pow(2).mean()


@settings(max_examples=8, deadline=None, derandomize=True)
@given(form=st.sampled_from(sorted(ResidualNet.FORMS)), norm=st.sampled_from(["layer", "layer_without_affine", "rms"]),
       stream=st.booleans(), lead=st.sampled_from([(6,), (2, 3)]), n=st.sampled_from([16, 33]))
def test_only_exact_residual_adds_are_fused_and_the_step_computes_the_same(form, norm, stream, lead, n) -> None:
    """Random small nets: the forward is fused exactly for the exact forms (two same-shape floating
    tensors added, no alpha, the norm reading the sum) and a near miss (broadcast, alpha, a norm of
    a scaled sum) leaves the norm and the add as they were; the backward is fused exactly when
    the norm's input gradient is accumulated (its input read again: `stream`), whatever the
    forward form; loss and gradients equal the unfused program's."""
    torch.manual_seed(0)
    model = ResidualNet(n, norm, form, stream)
    x = torch.randn(*lead, 8)
    step, inputs, plain = fused_step(model, (x,), {})
    gm = step.captured.gm
    kind = "rms" if norm == "rms" else "layer"
    before = count_targets(gm)
    assert before[NORM_FWD[kind]] == 1, before  # fuse_kernels fused the norm (ATen's or written out)
    done = fuse_residual_norms(gm.graph, step.captured.module_of)
    gm.recompile()
    after = count_targets(gm)
    fwd, bwd = int(form in ResidualNet.FUSED), int(stream)
    assert (after.get(FWD[kind], 0), after.get(BWD[kind], 0), done) == (fwd, bwd, fwd + bwd), (form, after)
    if not fwd:
        assert after["aten.add.Tensor"] == before["aten.add.Tensor"] - bwd and after[NORM_FWD[kind]] == 1
    assert_same_outputs(step, run_step(gm, inputs), plain)


def test_an_add_with_alpha_is_left_alone() -> None:
    """aten.add.Tensor(x, r, alpha=2) (what a graph may carry when capture keeps the alpha): not
    the exact form; the norm and the add stay."""
    g = torch.fx.Graph()
    x, r, dy = g.placeholder("x"), g.placeholder("r"), g.placeholder("dy")
    h = g.call_function(aten.add.Tensor, (x, r), {"alpha": 2.0})
    f = g.call_function(torch.ops.fxspeed.rms_norm_fwd.default, (h, [8], None, 1e-6))
    y = g.call_function(operator.getitem, (f, 0))
    g.output((y,))
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        for ph in (x, r, dy):
            ph.meta["val"] = mode.from_tensor(torch.empty(4, 8))
        for node in (h, f, y):
            args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda a: a.meta["val"])
            node.meta["val"] = node.target(*args, **kwargs)
    assert fuse_residual_norms(g, {}) == 0
    assert [n.target for n in g.nodes if n.op == "call_function"] == [aten.add.Tensor,
                                                                     torch.ops.fxspeed.rms_norm_fwd.default,
                                                                     operator.getitem]


# --- the cuda tier ----------------------------------------------------------------------------

@pytest.mark.parametrize("res", ["same", "bf16"])
@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("shape", [(1, 1), (37, 300), (512, 768), (64, 8192)])
@compiled_on_cuda
def test_the_compiled_kernels_match_torch_on_cuda(shape, dtype, res) -> None:
    """Compiled Triton rounds h as ATen's add does: bit for bit here, bf16 included."""
    x = torch.randn(*shape, dtype=DTYPES[dtype], device="cuda") * 3 + 1
    w, b = affine_params(shape[1], x.dtype, "weight+bias", "cuda")
    check_add_layer_norm(x, residual_of(x, res), w, b, dtype)
    check_add_rms_norm(x, residual_of(x, res), w, 1e-6, dtype)


@compiled_on_cuda
def test_on_cuda_a_gpt_trained_with_residual_norms_fused_matches_eager(monkeypatch) -> None:
    """Without FXSPEED_FUSE_ON_CPU: fuse_kernels runs because the program is on CUDA."""
    monkeypatch.delenv("FXSPEED_FUSE_ON_CPU", raising=False)
    counts = wire(monkeypatch, "after_recompute_pointwise")
    model = tiny_gpt(2).cuda()
    batches = [(torch.randint(0, 64, (2, 16), device="cuda"), torch.randint(0, 64, (2, 16), device="cuda"))
               for _ in range(3)]
    check_parity(model, batches, fxspeed.Config(optimizer="sgd", lr=0.1), rtol=1e-5)
    assert counts and counts[0] == 8, counts
    assert residual_norms._fused_kernels.cache_info().currsize == 1
