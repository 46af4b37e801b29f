"""The fusion pass (passes/graph/fuse_kernels.py) and its Triton norm kernels (runtime/kernels/norms.py).

Kernels against torch, forward and backward, with hypothesis-drawn shapes and dtypes, under
Triton's interpreter on CPU tensors. TRITON_INTERPRET must be set before triton is first
imported (its language functions are jit'd then), and importing torch's AOT autograd (so
fxspeed, so conftest) imports triton when it is installed; so the kernel tests run in a child
pytest started with TRITON_INTERPRET=1 (`test_the_kernels_match_torch_under_triton_s_interpreter`),
and are skipped in a process without it. On a GPU machine the `cuda` test at the bottom checks
the compiled kernels. The graph tests need no triton: without it the custom ops run their
torch fallback.
"""

from __future__ import annotations

import copy
import operator
import os

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from conftest import assert_close_rel, check_parity, rel_err
from hypothesis import given, settings
from hypothesis import strategies as st

import fxspeed
from fxspeed.compiler import PassOptions
from fxspeed.compiler.pass_manager import PassContext
from fxspeed.compiler.pipelines import compile_step
from fxspeed.ir import META_KEY, StepSignature
from fxspeed.models import GPT, GPTConfig
from fxspeed.passes.graph.fuse_kernels import fuse_kernels
from fxspeed.runtime.kernels import norms

# set by the caller, so before triton was imported: the kernels run interpreted
_INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
ROOT = Path(__file__).resolve().parents[1]
INTERPRETED_TESTS = ("test_layer_norm_kernels_return_what_native_layer_norm_and_its_backward_return",
                     "test_rms_norm_kernels_match_fused_rms_norm_and_autograd_through_it",
                     "test_a_transformer_trained_with_fused_norms_has_no_aten_norms_left_and_matches_eager")

aten = torch.ops.aten
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# allowed against torch: ||a - b|| <= TOL ||b|| + ATOL sqrt(numel) (ATOL: values that are zero in
# exact arithmetic, e.g. the input gradient of a one-element RMSNorm row, come out as rounding noise)
TOL = {"fp32": 1e-5, "bf16": 2e-2, "fp16": 4e-3}
ATOL = {"fp32": 1e-6, "bf16": 1e-2, "fp16": 1e-3}
NORM_TARGETS = {aten.native_layer_norm.default, aten.native_layer_norm_backward.default}


def needs_interpreter() -> None:
    pytest.importorskip("triton")
    if not _INTERPRETING:
        pytest.skip("runs in a child process with TRITON_INTERPRET=1 "
                    "(test_the_kernels_match_torch_under_triton_s_interpreter)")


def test_the_kernels_match_torch_under_triton_s_interpreter() -> None:
    """Runs the kernel tests above in a child pytest that sets TRITON_INTERPRET=1 from the start."""
    pytest.importorskip("triton")
    if _INTERPRETING:
        pytest.skip("this is the interpreted run")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
                        *(f"{Path(__file__).relative_to(ROOT)}::{t}" for t in INTERPRETED_TESTS)],
                       cwd=ROOT, env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0 and f"{len(INTERPRETED_TESTS)} passed" in r.stdout and " skipped" not in r.stdout, \
        r.stdout[-4000:] + r.stderr[-2000:]


def close(a: torch.Tensor, b: torch.Tensor, what: str, dtype: str, scale: float = 1.0) -> None:
    """`scale`: the size of the values' terms (an input gradient's is |grad_out| x rstd)."""
    assert a.shape == b.shape and a.dtype == b.dtype, f"{what}: {a.shape} {a.dtype} vs torch {b.shape} {b.dtype}"
    diff, ref = (a.double() - b.double()).norm().item(), b.double().norm().item()
    assert diff <= TOL[dtype] * ref + ATOL[dtype] * scale * a.numel() ** 0.5, \
        f"{what} ({dtype}): relative error {rel_err(a, b):.3g} > {TOL[dtype]:g} (||a - b|| = {diff:.3g})"


def grad_scales(x: torch.Tensor, g: torch.Tensor, rstd: torch.Tensor) -> dict[str, float]:
    """The size of each gradient's terms, for the absolute floor of `close`: the input gradient's
    are |grad_out| x rstd; the weight and bias gradients sum |grad_out| x |x| x rstd over the
    rows (rounding noise grows as sqrt(rows)). With one column, x - mean is 0 in exact
    arithmetic and rstd = 1/sqrt(eps): these gradients are rounding noise times 300."""
    g_max, r_max = float(g.abs().max()), float(rstd.float().max())
    rows = g.numel() // g.shape[-1]
    param = rows ** 0.5 * g_max * max(1.0, float(x.abs().max()) * r_max)
    return {"grad_input": g_max * r_max, "grad_weight": param, "grad_bias": param}


shapes = st.tuples(st.integers(1, 64), st.integers(1, 300))
dtypes = st.sampled_from(sorted(DTYPES))


@settings(max_examples=8, deadline=None)
@given(shape=shapes, dtype=dtypes, affine=st.sampled_from(["weight+bias", "weight", "none"]),
       lead=st.sampled_from([(), (2,)]))
def test_layer_norm_kernels_return_what_native_layer_norm_and_its_backward_return(shape, dtype, affine, lead) -> None:
    needs_interpreter()
    m, n = shape
    dt = DTYPES[dtype]
    x = torch.randn(*lead, m, n, dtype=dt) * 3 + 1
    w = torch.randn(n, dtype=dt) if affine != "none" else None
    b = torch.randn(n, dtype=dt) if affine == "weight+bias" else None
    g = torch.randn(*lead, m, n, dtype=dt)
    assert norms.use_triton(x, w, b)
    out = norms.layer_norm_fwd(x, [n], w, b, 1e-5)
    ref = aten.native_layer_norm.default(x, [n], w, b, 1e-5)
    for name, a, r in zip(("out", "mean", "rstd"), out, ref):
        close(a, r, name, dtype)
    grads = norms.layer_norm_bwd(g, x, [n], ref[1], ref[2], w, b)
    ref_grads = aten.native_layer_norm_backward.default(g, x, [n], ref[1], ref[2], w, b, [True, w is not None, b is not None])
    scales = grad_scales(x, g, ref[2])
    for name, a, r in zip(("grad_input", "grad_weight", "grad_bias"), grads, ref_grads):
        if r is None:
            assert a.numel() == 0, f"{name}: an absent parameter's gradient is an empty tensor"
        else:
            close(a, r, name, dtype, scales[name])


@settings(max_examples=8, deadline=None)
@given(shape=shapes, dtype=dtypes, weight=st.booleans(), eps=st.sampled_from([None, 1e-6]))
def test_rms_norm_kernels_match_fused_rms_norm_and_autograd_through_it(shape, dtype, weight, eps) -> None:
    needs_interpreter()
    m, n = shape
    dt = DTYPES[dtype]
    x = (torch.randn(m, n, dtype=dt) * 2).requires_grad_()
    w = torch.randn(n, dtype=dt).requires_grad_() if weight else None
    g = torch.randn(m, n, dtype=dt)
    out, rstd = norms.rms_norm_fwd(x.detach(), [n], w.detach() if weight else None, eps)
    ref, ref_rstd = aten._fused_rms_norm.default(x, [n], w, eps)  # a composite on CPU: autograd runs through it
    close(out, ref.detach(), "out", dtype)
    close(rstd, ref_rstd.detach(), "rstd", dtype)
    dx, dw = norms.rms_norm_bwd(g, x.detach(), [n], ref_rstd.detach(), w.detach() if weight else None)
    ref_grads = torch.autograd.grad(ref, [x, *([w] if weight else [])], g)
    close(dx, ref_grads[0], "grad_input", dtype, float(g.abs().max()) * float(ref_rstd.detach().max()))
    if weight:
        close(dw, ref_grads[1], "grad_weight", dtype)
    else:
        assert dw.numel() == 0


def test_the_fake_implementations_give_aten_s_shapes_and_dtypes() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(4, 6, 10, dtype=torch.bfloat16)
        w, b = torch.empty(10, dtype=torch.bfloat16), torch.empty(10, dtype=torch.bfloat16)
        got = norms.layer_norm_fwd(x, [10], w, b, 1e-5)
        want = aten.native_layer_norm.default(x, [10], w, b, 1e-5)
        assert [(t.shape, t.dtype) for t in got] == [(t.shape, t.dtype) for t in want]
        got = norms.rms_norm_fwd(x, [10], w, None)
        want = aten._fused_rms_norm.default(x, [10], w, None)
        assert [(t.shape, t.dtype) for t in got] == [(t.shape, t.dtype) for t in want]


def tiny_gpt() -> GPT:
    return GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=32))


def gpt_batches(steps: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))) for _ in range(steps)]


def norm_nodes(gm: torch.fx.GraphModule) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function" and "norm" in str(n.target)]


def test_a_transformer_trained_with_fused_norms_has_no_aten_norms_left_and_matches_eager(monkeypatch) -> None:
    """Here the custom ops run their torch fallback; in the interpreted run, the Triton kernels."""
    monkeypatch.setenv("FXSPEED_FUSE_ON_CPU", "1")
    model, batches = tiny_gpt(), gpt_batches()
    step = compile_step(copy.deepcopy(model), batches[0], {}, config=fxspeed.Config(), loss_fn=None)
    # SGD: AdamW turns the rounding noise of a gradient that is zero in exact arithmetic (the key
    # bias: softmax ignores a constant added to every key) into whole-size updates of either sign
    config = fxspeed.Config(optimizer="sgd", lr=0.1)
    engine, _ = check_parity(model, batches, config, rtol=1e-5)
    assert any(p["name"] == "fuse_kernels" and p["modified"] for p in engine.plan.passes)
    targets = norm_nodes(step.captured.gm)
    assert not any(t.startswith("aten.native_layer_norm") for t in targets), targets
    assert targets.count("fxspeed.layer_norm_fwd.default") == 3 and targets.count("fxspeed.layer_norm_bwd.default") == 3
    if _INTERPRETING and norms.triton_available():
        assert norms._make_kernels.cache_info().currsize == 1, "the steps ran the Triton kernels"


def test_the_pass_does_nothing_on_cpu_by_default(monkeypatch) -> None:
    monkeypatch.delenv("FXSPEED_FUSE_ON_CPU", raising=False)
    assert PassOptions.single_device(fxspeed.Config()).fuse_kernels == "cuda"
    x, y = gpt_batches(1)[0]
    step = compile_step(tiny_gpt(), (x, y), {}, config=fxspeed.Config(), loss_fn=None)
    assert "aten.native_layer_norm.default" in norm_nodes(step.captured.gm)
    assert "fuse_kernels" not in [r.name for r in step.records]  # not even run: nothing of it in the records
    res = fuse_kernels(step.captured.gm, PassContext(signature=step.captured.signature, options=PassOptions()))
    assert not res.modified


def test_disabling_fuse_kernels_by_name_keeps_aten_s_norms(monkeypatch) -> None:
    monkeypatch.setenv("FXSPEED_FUSE_ON_CPU", "1")
    x, y = gpt_batches(1)[0]
    step = compile_step(tiny_gpt(), (x, y), {}, config=fxspeed.Config(disable_passes=("fuse_kernels",)), loss_fn=None)
    assert "aten.native_layer_norm.default" in norm_nodes(step.captured.gm)
    assert next(r for r in step.records if r.name == "fuse_kernels").skipped


def test_a_fused_norm_costs_what_the_aten_norm_it_replaces_costs(monkeypatch) -> None:
    """The planner's inputs (NodeInfo from annotate) stay right: a fused node reads and writes
    the bytes ATen's node did, with the same FLOPs, role and module."""
    x, y = gpt_batches(1)[0]
    model = tiny_gpt()
    monkeypatch.setenv("FXSPEED_FUSE_ON_CPU", "1")
    fused = compile_step(copy.deepcopy(model), (x, y), {}, config=fxspeed.Config(), loss_fn=None).captured.gm
    monkeypatch.delenv("FXSPEED_FUSE_ON_CPU")
    plain = compile_step(copy.deepcopy(model), (x, y), {}, config=fxspeed.Config(disable_passes=("fuse_kernels",)),
                         loss_fn=None).captured.gm

    def costs(gm, kinds):
        return [(n.meta[META_KEY].bytes_read, n.meta[META_KEY].bytes_written, n.meta[META_KEY].flops,
                 n.meta[META_KEY].role, n.meta[META_KEY].module)
                for n in gm.graph.nodes if n.op == "call_function" and str(n.target) in kinds]

    assert costs(fused, {"fxspeed.layer_norm_fwd.default", "fxspeed.layer_norm_bwd.default"}) == \
        costs(plain, {"aten.native_layer_norm.default", "aten.native_layer_norm_backward.default"})
    assert all(m for *_, m in costs(fused, {"fxspeed.layer_norm_fwd.default"}))


def test_rms_norm_ops_are_replaced_and_the_rewritten_graph_computes_their_gradients() -> None:
    """aten._fused_rms_norm (what nn.RMSNorm is on CUDA; on CPU it decomposes at capture, so
    the graph is built by hand) and its backward become fxspeed's ops."""
    g = torch.fx.Graph()
    x, w, dy = g.placeholder("x"), g.placeholder("w"), g.placeholder("dy")
    fwd = g.call_function(aten._fused_rms_norm.default, (x, [8], w, 1e-6))
    out, rstd = g.call_function(operator.getitem, (fwd, 0)), g.call_function(operator.getitem, (fwd, 1))
    bwd = g.call_function(aten._fused_rms_norm_backward.default, (dy, x, [8], rstd, w, [True, True]))
    gx, gw = g.call_function(operator.getitem, (bwd, 0)), g.call_function(operator.getitem, (bwd, 1))
    g.output((out, gx, gw))
    gm = torch.fx.GraphModule(nn.Module(), g)
    vals = (torch.randn(5, 8, requires_grad=True), torch.randn(8, requires_grad=True), torch.randn(5, 8))
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        for ph, v in zip((x, w, dy), vals):
            ph.meta["val"] = mode.from_tensor(v.detach())
        for n in (fwd, out, rstd, bwd, gx, gw):
            args = torch.fx.node.map_arg(n.args, lambda a: a.meta["val"])
            n.meta["val"] = n.target(*args)
    res = fuse_kernels(gm, PassContext(signature=StepSignature(), options=PassOptions(fuse_kernels="always")))
    assert res.modified
    res.gm.recompile()
    assert [str(t) for t in norm_nodes(res.gm)] == ["fxspeed.rms_norm_fwd.default", "fxspeed.rms_norm_bwd.default"]
    got = res.gm(*(v.detach() for v in vals))
    ref = aten._fused_rms_norm.default(vals[0], [8], vals[1], 1e-6)[0]
    ref_gx, ref_gw = torch.autograd.grad(ref, vals[:2], vals[2])
    for name, a, r in zip(("out", "grad_input", "grad_weight"), got, (ref.detach(), ref_gx, ref_gw)):
        assert_close_rel(a, r, name)


# --- the cuda tier ----------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the cuda tier needs a CUDA device")
@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("shape", [(1, 1), (37, 300), (512, 768), (4096, 4096), (64, 8192)])
def test_the_compiled_kernels_match_torch_on_cuda(shape, dtype) -> None:
    pytest.importorskip("triton")
    if _INTERPRETING:
        pytest.skip("TRITON_INTERPRET=1: this test checks the compiled kernels")
    m, n = shape
    dt = DTYPES[dtype]
    dev = torch.device("cuda")
    x = torch.randn(m, n, dtype=dt, device=dev) * 3 + 1
    w, b = torch.randn(n, dtype=dt, device=dev), torch.randn(n, dtype=dt, device=dev)
    g = torch.randn(m, n, dtype=dt, device=dev)
    assert norms.use_triton(x, w, b)
    out = norms.layer_norm_fwd(x, [n], w, b, 1e-5)
    ref = aten.native_layer_norm.default(x, [n], w, b, 1e-5)
    for name, a, r in zip(("out", "mean", "rstd"), out, ref):
        close(a, r, name, dtype)
    scales = grad_scales(x, g, ref[2])
    for name, a, r in zip(("grad_input", "grad_weight", "grad_bias"),
                          norms.layer_norm_bwd(g, x, [n], ref[1], ref[2], w, b),
                          aten.native_layer_norm_backward.default(g, x, [n], ref[1], ref[2], w, b, [True] * 3)):
        close(a, r, name, dtype, scales[name])
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    ref, ref_rstd = aten._fused_rms_norm.default(xr, [n], wr, 1e-6)
    out, rstd = norms.rms_norm_fwd(x, [n], w, 1e-6)
    close(out, ref.detach(), "rms out", dtype)
    close(rstd, ref_rstd.detach(), "rms rstd", dtype)
    dx, dw = norms.rms_norm_bwd(g, x, [n], ref_rstd.detach(), w)
    rdx, rdw = torch.autograd.grad(ref, [xr, wr], g)
    close(dx, rdx, "rms grad_input", dtype, float(g.abs().max()) * float(ref_rstd.detach().max()))
    close(dw, rdw, "rms grad_weight", dtype)


class RMSNormMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.norm, self.b = nn.Linear(64, 256), nn.RMSNorm(256), nn.Linear(256, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.norm(torch.relu(self.a(x)))).pow(2).mean()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the cuda tier needs a CUDA device")
def test_on_cuda_the_pass_fuses_layer_and_rms_norms_by_default_and_training_matches_eager(monkeypatch) -> None:
    pytest.importorskip("triton")
    if _INTERPRETING:
        pytest.skip("TRITON_INTERPRET=1: this test checks the compiled kernels")
    monkeypatch.delenv("FXSPEED_FUSE_ON_CPU", raising=False)
    config = fxspeed.Config(optimizer="sgd", lr=0.1)  # why SGD: see the CPU transformer test
    gpt = tiny_gpt().cuda()
    batches = [(x.cuda(), y.cuda()) for x, y in gpt_batches()]
    engine, _ = check_parity(gpt, batches, config, rtol=1e-5)
    assert any(p["name"] == "fuse_kernels" and p["modified"] for p in engine.plan.passes)
    mlp = RMSNormMLP().cuda()
    x = torch.randn(8, 64, device="cuda")
    step = compile_step(copy.deepcopy(mlp), (x,), {}, config=config, loss_fn=None)
    targets = norm_nodes(step.captured.gm)
    assert targets == ["fxspeed.rms_norm_fwd.default", "fxspeed.rms_norm_bwd.default"], \
        f"nn.RMSNorm on CUDA was captured as {targets or 'decomposed ATen ops'}; the pass fused only {targets}"
    check_parity(mlp, [(torch.randn(8, 64, device="cuda"),) for _ in range(3)], config, rtol=1e-5)
