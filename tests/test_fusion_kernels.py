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


import pytest
import torch
import torch.nn as nn
from conftest import (INTERPRETING, assert_close_rel, assert_models_match, check_parity,
                      fxspeed_train, needs_interpreter, rel_err, run_interpreted)
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
INTERPRETED_TESTS = ("test_layer_norm_kernels_return_what_native_layer_norm_and_its_backward_return",
                     "test_rms_norm_kernels_match_fused_rms_norm_and_autograd_through_it",
                     "test_a_transformer_trained_with_fused_norms_has_no_aten_norms_left_and_matches_eager",
                     "test_nn_rms_norm_on_cpu_is_fused_and_trains_like_eager")

aten = torch.ops.aten
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# allowed against torch: ||a - b|| <= TOL ||b|| + ATOL sqrt(numel) (ATOL: values that are zero in
# exact arithmetic, e.g. the input gradient of a one-element RMSNorm row, come out as rounding noise)
TOL = {"fp32": 1e-5, "bf16": 2e-2, "fp16": 4e-3}
ATOL = {"fp32": 1e-6, "bf16": 1e-2, "fp16": 1e-3}
NORM_TARGETS = {aten.native_layer_norm.default, aten.native_layer_norm_backward.default}




def test_the_kernels_match_torch_under_triton_s_interpreter() -> None:
    """Runs the kernel tests above in a child pytest that sets TRITON_INTERPRET=1 from the start."""
    run_interpreted(__file__, INTERPRETED_TESTS)


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
    # recompute_pointwise also runs each fused forward again in backward (its output is read there)
    again = sum(1 for n in step.captured.gm.graph.nodes
                if "recomputed_pointwise" in n.meta and str(n.target) == "fxspeed.layer_norm_fwd.default")
    # 3 norms, the last two reading a residual add (fuse_residual_norms), whose gradient the first
    # two backwards accumulate (the last one's input gradient has no residual reader)
    fwd = targets.count("fxspeed.layer_norm_fwd.default") - again
    assert (fwd, targets.count("fxspeed.add_layer_norm_fwd.default")) == (1, 2), targets
    assert (targets.count("fxspeed.layer_norm_bwd.default"), targets.count("fxspeed.layer_norm_bwd_add.default")) \
        == (1, 2), targets
    if INTERPRETING and norms.triton_available():
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
    # node for node: recompute_pointwise off (it would run the fused forwards again in backward),
    # and the norms alone fused
    fused = compile_step(copy.deepcopy(model), (x, y), {},
                         config=fxspeed.Config(disable_passes=("recompute_pointwise", *NORMS_ONLY)), loss_fn=None).captured.gm
    monkeypatch.delenv("FXSPEED_FUSE_ON_CPU")
    plain = compile_step(copy.deepcopy(model), (x, y), {}, config=fxspeed.Config(disable_passes=UNFUSED),
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


# --- RMSNorm written out in ATen ops (passes/graph/rms_norm_pattern.py) ---------------------------

RMS_TARGETS = ("fxspeed.rms_norm_fwd.default", "fxspeed.rms_norm_bwd.default")


def count_targets(gm: torch.fx.GraphModule) -> dict[str, int]:
    out: dict[str, int] = {}
    for n in gm.graph.nodes:
        if n.op == "call_function":
            out[str(n.target)] = out.get(str(n.target), 0) + 1
    return out


def step_inputs(step, model: nn.Module, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The captured step's inputs, bound by their signature (parameters, buffers, then the batch)."""
    batch = [*args, *kwargs.values()]
    bind = {"param": model.get_parameter, "buffer": model.get_buffer, "input": lambda t: batch[int(t)]}
    return [bind[s.kind](s.target).detach() for s in step.captured.signature.inputs]


def run_step(gm: torch.fx.GraphModule, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    out = gm(*inputs)
    return list(out[0] if isinstance(out, (tuple, list)) and len(out) == 1 else out)


# The matcher is run by hand on a program compiled without it; recompute_pointwise (which runs
# after fuse_kernels in the pipeline) is off there too, or the norms' products would already be
# recomputed in backward when the matcher looks.
UNFUSED = ("fuse_kernels", "fuse_rotary", "fuse_activations", "fuse_residual_norms", "recompute_pointwise")
NORMS_ONLY = ("fuse_rotary", "fuse_activations", "fuse_residual_norms")  # fuse_kernels' norms, no other fusion


def fuse_in_place(step) -> None:
    """Run fuse_kernels on a step compiled without it (the same program, so the same values)."""
    ctx = PassContext(signature=step.captured.signature, module_of=dict(step.captured.module_of),
                      options=PassOptions(fuse_kernels="always"))
    fuse_kernels(step.captured.gm, ctx)
    step.captured.gm.recompile()


def tiny_hf(kind: str, layers: int = 2) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    make = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
            "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
            "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}[kind]
    cfg = make[0](vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=32)
    return make[1](cfg)


def rms_modules(model: nn.Module) -> int:
    return sum(type(m).__name__.endswith("RMSNorm") for m in model.modules())


def hf_batches(steps: int = 3) -> list[dict[str, torch.Tensor]]:
    return [{"input_ids": (i := torch.randint(0, 64, (2, 8))), "labels": i} for _ in range(steps)]


def test_hf_llama_s_written_out_rms_norms_become_one_fused_pair_each_with_the_same_loss_and_gradients(
        monkeypatch) -> None:
    """Forward and backward of each LlamaRMSNorm (pow, mean, add, rsqrt, mul, mul and a dozen
    backward ops) -> fxspeed.rms_norm_fwd / _bwd; the step's loss and every gradient equal
    the unfused program's; the planner sees fewer activation bytes and a lower peak."""
    monkeypatch.setenv("FXSPEED_FUSE_ON_CPU", "1")
    model, batch = tiny_hf("llama"), hf_batches(1)[0]
    step = compile_step(model, (), batch, config=fxspeed.Config(disable_passes=UNFUSED), loss_fn=None)
    inputs = step_inputs(step, model, (), batch)
    plain = run_step(step.captured.gm, inputs)
    fuse_in_place(step)
    counts = count_targets(step.captured.gm)
    norms_n = rms_modules(model)
    assert norms_n == 5 and "aten.rsqrt.default" not in counts, counts
    assert [counts.get(t, 0) for t in RMS_TARGETS] == [norms_n, norms_n]
    fused = run_step(step.captured.gm, inputs)
    names = ["loss", *(s.target for s in step.captured.signature.outputs[1:])]
    for name, a, b in zip(names, fused, plain, strict=True):
        assert_close_rel(a, b, name, 1e-5)

    def planned(disable: tuple[str, ...]) -> fxspeed.Plan:
        return fxspeed.plan(model, 1, fxspeed.Config(disable_passes=disable), example_inputs=batch)

    with_fusion, without = planned(()), planned(("fuse_kernels",))
    assert with_fusion.memory(0)["activations"] < without.memory(0)["activations"]
    assert with_fusion.peak_memory(0) < without.peak_memory(0)


@pytest.mark.parametrize("kind,precision,rtol", [("llama", "fp32", 1e-5), ("mistral", "bf16", 1e-4)])
def test_hf_models_with_fused_rms_norms_train_like_the_unfused_program(monkeypatch, kind, precision, rtol) -> None:
    """Three AdamW steps: losses and updated parameters of the program with fused norms equal the
    unfused one's (bf16: the norms stay fp32 under insert_casts, so only summation order differs;
    the fused SwiGLU, which rounds once where the unfused ops round after each, is left out)."""
    model, batches = tiny_hf(kind, layers=1), hf_batches()
    config = fxspeed.Config(precision=precision, optimizer="adamw", lr=1e-3, disable_passes=("fuse_activations",))
    plain_model = copy.deepcopy(model)
    monkeypatch.setenv("FXSPEED_FUSE_ON_CPU", "1")
    engine, losses = fxspeed_train(model, batches, config)
    assert any(p["name"] == "fuse_kernels" and p["modified"] for p in engine.plan.passes)
    monkeypatch.delenv("FXSPEED_FUSE_ON_CPU")
    _, plain_losses = fxspeed_train(plain_model, batches, config)
    for i, (a, b) in enumerate(zip(losses, plain_losses)):
        assert_close_rel(a, b, f"loss at step {i}", rtol)
    assert_models_match(model, plain_model, rtol)


def test_nn_rms_norm_on_cpu_is_fused_and_trains_like_eager(monkeypatch) -> None:
    """nn.RMSNorm decomposes on CPU (mean over [2], add.Scalar, eps = fp32's machine epsilon,
    weight on the right): the same matcher fuses it; three SGD steps equal eager's."""
    monkeypatch.setenv("FXSPEED_FUSE_ON_CPU", "1")
    model, x = RMSNormMLP(), torch.randn(3, 5, 64)
    step = compile_step(copy.deepcopy(model), (x,), {}, config=fxspeed.Config(), loss_fn=None)
    counts = count_targets(step.captured.gm)
    again = sum(1 for n in step.captured.gm.graph.nodes if "recomputed_pointwise" in n.meta
                and str(n.target) == RMS_TARGETS[0])  # the forward run again in backward (recompute_pointwise)
    assert "aten.rsqrt.default" not in counts and [counts.get(t, 0) for t in RMS_TARGETS] == [1 + again, 1], counts
    launches = []
    kernels = norms._kernels
    monkeypatch.setattr(norms, "_kernels", lambda: launches.append(1) or kernels())
    check_parity(model, [(torch.randn(3, 5, 64),) for _ in range(3)], fxspeed.Config(optimizer="sgd", lr=0.1))
    if INTERPRETING and norms.triton_available():  # in the interpreted run, the Triton kernels trained it
        assert len(launches) >= 6, launches


class WrittenOutRMSNorm(nn.Module):
    """An RMSNorm as people write it; `form` "hf" is the matched one, the others are not RMSNorm."""

    def __init__(self, n: int, weight: bool, eps: float, form: str, cast: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(n)) if weight else None
        self.eps, self.form, self.cast = eps, form, cast

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32) if self.cast else x  # HF's upcast (a no-op on an fp32 x)
        if self.form == "mean_over_dim_0":
            var = h.pow(2).mean(0, keepdim=True)
        elif self.form == "fourth_power":
            var = h.pow(4).mean(-1, keepdim=True)
        else:
            var = h.pow(2).mean(-1, keepdim=True)
        r = torch.rsqrt(var) + self.eps if self.form == "eps_after_rsqrt" else torch.rsqrt(var + self.eps)
        h = h * r
        if self.cast:
            h = h.to(dtype)
        return self.weight * h if self.weight is not None else h


class NormNet(nn.Module):
    """Linear -> written-out RMSNorm (applied `uses` times, its weight shared) -> head(s)."""

    def __init__(self, n: int, norm: WrittenOutRMSNorm, uses: int, output_twice: bool, low_input: bool) -> None:
        super().__init__()
        self.a, self.norm, self.b = nn.Linear(8, n), norm, nn.Linear(n, 4)
        self.c = nn.Linear(n, n) if uses > 1 else None
        self.d = nn.Linear(n, 4) if output_twice else None
        self.low_input = low_input

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if self.low_input:
            h = h.to(torch.bfloat16)  # the norm's input is low: its casts (if any) are real
        y = self.norm(h)
        if self.c is not None:
            y = self.norm(self.c(y.float()) + h.float())  # the weight read twice: a tied gradient
        out = self.b(y.float())
        if self.d is not None:
            out = out + self.d(y.float()).relu()  # the norm's output read twice: its gradient is a sum
        return out.pow(2).mean()


FORMS = ("hf", "hf", "mean_over_dim_0", "fourth_power", "eps_after_rsqrt")


@settings(max_examples=25, deadline=None, derandomize=True)
@given(form=st.sampled_from(FORMS), weight=st.booleans(), eps=st.sampled_from([1e-6, 1e-5, 0.1]),
       cast=st.booleans(), low_input=st.booleans(), uses=st.sampled_from([1, 2]), output_twice=st.booleans(),
       lead=st.sampled_from([(6,), (2, 3)]), n=st.sampled_from([1, 16]))
def test_written_out_rms_norms_are_fused_exactly_when_they_are_rms_norms_and_compute_the_same(
        form, weight, eps, cast, low_input, uses, output_twice, lead, n) -> None:
    """Random small nets: the pass's program gives the unfused program's loss and gradients
    (whether it fused or not), fuses every RMSNorm of the matched form (one fused pair per
    application), and leaves the other forms' rsqrt and everything around it alone."""
    torch.manual_seed(0)
    model = NormNet(n, WrittenOutRMSNorm(n, weight, eps, form, cast), uses, output_twice, low_input)
    x = torch.randn(*lead, 8)
    step = compile_step(model, (x,), {}, config=fxspeed.Config(disable_passes=UNFUSED), loss_fn=None)
    inputs = step_inputs(step, model, (x,), {})
    before = count_targets(step.captured.gm)
    plain = run_step(step.captured.gm, inputs)
    fuse_in_place(step)
    after = count_targets(step.captured.gm)
    fused = run_step(step.captured.gm, inputs)
    # n = 1: autograd drops the sum over a one-element dim, a form never seen in a model; a bf16
    # input without the upcast: the region itself is bf16 (the kernels would compute fp32). Untouched.
    # The second application (uses = 2) reads c(y) + h.float(), fp32 whatever the first read.
    fused_regions = 0 if form != "hf" or n == 1 else uses if (cast or not low_input) else uses - 1
    if fused_regions == uses:
        assert "aten.rsqrt.default" not in after and [after.get(t, 0) for t in RMS_TARGETS] == [uses, uses], after
    elif fused_regions:
        assert [after.get(t, 0) for t in RMS_TARGETS] == [fused_regions] * 2 and after["aten.rsqrt.default"] == 1, after
    else:
        assert after == before, "a form that is not matched was rewritten"
    names = ["loss", *(s.target for s in step.captured.signature.outputs[1:])]
    # fp32 arithmetic either way; with the low-precision input a rounding of h to bf16 may flip
    rtol = 1e-3 if low_input else 1e-5
    for name, a, b in zip(names, fused, plain, strict=True):
        assert_close_rel(a, b, name, rtol)


def test_a_recomputed_norm_is_fused_in_its_forward_and_in_its_recomputation(monkeypatch) -> None:
    """Activation checkpointing (HF gradient_checkpointing_enable): recompute_checkpointed
    copies the layer's norms into backward; fuse_kernels runs after it and fuses the first
    forward (forward only) and the recomputed copy with its backward; training is unchanged."""
    monkeypatch.setenv("FXSPEED_FUSE_ON_CPU", "1")
    model = tiny_hf("llama", layers=1)
    model.gradient_checkpointing_enable()
    model.train()
    batch = hf_batches(1)[0]
    step = compile_step(model, (), batch, config=fxspeed.Config(disable_passes=UNFUSED), loss_fn=None)
    inputs = step_inputs(step, model, (), batch)
    plain = run_step(step.captured.gm, inputs)
    fuse_in_place(step)
    counts = count_targets(step.captured.gm)
    # 3 norms; the layer's 2 run twice (forward, recomputation), only the recomputation has a backward
    assert "aten.rsqrt.default" not in counts and [counts.get(t, 0) for t in RMS_TARGETS] == [5, 3], counts
    for a, b in zip(run_step(step.captured.gm, inputs), plain, strict=True):
        assert_close_rel(a, b, "checkpointed step output", 1e-5)


# --- the cuda tier ----------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the cuda tier needs a CUDA device")
@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("shape", [(1, 1), (37, 300), (512, 768), (4096, 4096), (64, 8192)])
def test_the_compiled_kernels_match_torch_on_cuda(shape, dtype) -> None:
    pytest.importorskip("triton")
    if INTERPRETING:
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
    if INTERPRETING:
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
