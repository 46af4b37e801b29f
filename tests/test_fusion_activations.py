"""Fused activations: the kernels (runtime/kernels/activations.py) and the matcher that puts them
into training graphs (passes/graph/activation_pattern.py): SwiGLU, GPT-2's written-out tanh GELU,
aten.gelu, and a bias add of its own before a GELU.

The kernel tests run under Triton's interpreter in a child pytest started with TRITON_INTERPRET=1
(why: see tests/test_fusion_kernels.py) and are skipped in a process without it; the graph tests
run the ops' torch fallback here, and the training test runs again in the child, on the kernels.
The fused ops compute in fp32 and round once, so they are compared with the unfused programs for
closeness: tight in fp32, loose in bf16 (where the unfused ops round between steps).

compile_step runs the matcher as the fuse_activations pass, after fuse_kernels (programs without
tensor parallelism); the graph tests run both on a step compiled without them (`fuse_everything`).
"""

from __future__ import annotations

import math
import operator

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import (INTERPRETING, assert_close_rel, check_parity, needs_compiled_kernels,
                      needs_interpreter, run_interpreted)
from hypothesis import example, given, settings
from hypothesis import strategies as st

import fxspeed
from fxspeed.compiler.pipelines import compile_step
from fxspeed.ir import META_KEY
from fxspeed.models import GPT, GPTConfig
from fxspeed.passes.graph.activation_pattern import find_activations, fuse_activations
from fxspeed.runtime.kernels import activations
from fxspeed.runtime.kernels.norms import triton_available, use_triton
from test_fusion_kernels import (DTYPES, UNFUSED, close, count_targets, fuse_in_place, hf_batches, run_step,
                                       step_inputs, tiny_hf)

INTERPRETED_TESTS = ("test_swiglu_kernels_compute_silu_of_gate_times_up_and_its_gradients_in_fp32",
                     "test_gelu_kernels_compute_aten_s_gelu_and_its_gradient_with_and_without_a_bias",
                     "test_other_layouts_and_broadcasts_run_the_fallback_with_aten_s_values_and_strides",
                     "test_training_through_fxspeed_compile_with_fused_activations_matches_eager")
aten = torch.ops.aten
SWIGLU = ("fxspeed.swiglu_fwd.default", "fxspeed.swiglu_bwd.default")
GELU = ("fxspeed.gelu_fwd.default", "fxspeed.gelu_bwd.default")


def test_the_activation_kernels_pass_their_tests_under_triton_s_interpreter() -> None:
    """INTERPRETED_TESTS, in a child pytest with TRITON_INTERPRET=1 set before triton is imported."""
    run_interpreted(__file__, INTERPRETED_TESTS)


# --- the kernels ---------------------------------------------------------------------------------



def _name(dtype: torch.dtype) -> str:
    return next(k for k, v in DTYPES.items() if v == dtype)


def random_inputs(shape: list[int], dtype: torch.dtype, count: int) -> list[torch.Tensor]:
    return [(torch.randn(shape) * 3).to(dtype) for _ in range(count)]


def matches_reference(got: torch.Tensor, ref: torch.Tensor, what: str, scale: float = 1.0) -> None:
    """`got` against the fp64 value of the same inputs rounded once to got's dtype."""
    close(got, ref.detach().to(got.dtype), what, _name(got.dtype), scale)


shapes = st.lists(st.integers(1, 40), min_size=1, max_size=3)  # up to 64000 elements: many 1024-blocks, a partial one
dtypes = st.sampled_from(sorted(DTYPES))
written = st.sampled_from([None, "fp32", "bf16"])  # out dtype: the promoted one, an upcast kept, a cast folded


@settings(max_examples=8, deadline=None, derandomize=True)
@given(shape=shapes, dtype=dtypes, out=written, grad_up=written)
def test_swiglu_kernels_compute_silu_of_gate_times_up_and_its_gradients_in_fp32(shape, dtype, out, grad_up) -> None:
    needs_interpreter()
    g, u, dy = random_inputs(shape, DTYPES[dtype], 3)
    assert use_triton(g, u, dy)
    y = activations.swiglu_fwd(g, u, DTYPES.get(out))
    gg, gu = activations.swiglu_bwd(dy, g, u, DTYPES.get(out), DTYPES.get(grad_up))
    assert (y.dtype, gg.dtype, gu.dtype) == (DTYPES.get(out, g.dtype), DTYPES.get(out, g.dtype),
                                             DTYPES.get(grad_up, g.dtype))
    g64, u64 = g.double().requires_grad_(), u.double().requires_grad_()
    ref = F.silu(g64) * u64
    matches_reference(y, ref, "out")
    ref_gg, ref_gu = torch.autograd.grad(ref, [g64, u64], dy.double())
    matches_reference(gg, ref_gg, "grad_gate")
    matches_reference(gu, ref_gu, "grad_up")
    assert activations._make_kernels.cache_info().currsize == 1, "the Triton kernels computed these"


@settings(max_examples=10, deadline=None, derandomize=True)
@given(shape=shapes, dtype=dtypes, approximate=st.sampled_from(["none", "tanh"]), bias=st.booleans(), out=written)
def test_gelu_kernels_compute_aten_s_gelu_and_its_gradient_with_and_without_a_bias(shape, dtype, approximate, bias,
                                                                                   out) -> None:
    needs_interpreter()
    x, dy = random_inputs(shape, DTYPES[dtype], 2)
    b = torch.randn(shape[-1]).to(DTYPES[dtype]) if bias else None
    assert use_triton(x, dy, b)
    y = activations.gelu_fwd(x, approximate, b, DTYPES.get(out))
    dx = activations.gelu_bwd(dy, x, approximate, b, DTYPES.get(out))
    assert y.dtype == dx.dtype == DTYPES.get(out, x.dtype)
    h = (x.double() + (b.double() if bias else 0)).requires_grad_()
    ref = F.gelu(h, approximate=approximate)
    matches_reference(y, ref, "out")
    matches_reference(dx, torch.autograd.grad(ref, [h], dy.double())[0], "grad_input")
    assert activations._make_kernels.cache_info().currsize == 1, "the Triton kernels computed these"


def op_calls() -> list[tuple[str, tuple, torch.Tensor]]:
    """(what, the fused op's call, what ATen's ops give) over layouts and broadcasts the kernels do
    not take (a transposed operand, a broadcast one, an empty tensor) and ones they do."""
    g, u, row, b, empty = torch.randn(6, 10), torch.randn(6, 10), torch.randn(10), torch.randn(10), torch.randn(0, 10)
    gt, ut = torch.randn(10, 6).t(), torch.randn(10, 6).t()
    sig = torch.sigmoid(gt)
    fused = torch.ops.fxspeed
    return [("swiglu", (fused.swiglu_fwd, g, u), F.silu(g) * u),
            ("swiglu transposed", (fused.swiglu_fwd, gt, ut), F.silu(gt) * ut),
            ("swiglu broadcast up", (fused.swiglu_fwd, g, row), F.silu(g) * row),
            ("swiglu empty", (fused.swiglu_fwd, empty, empty), F.silu(empty) * empty),
            ("swiglu_bwd transposed", (fused.swiglu_bwd, gt, gt, ut), gt * ut * (sig * (1 + gt * (1 - sig)))),
            ("gelu transposed", (fused.gelu_fwd, gt, "tanh"), F.gelu(gt, approximate="tanh")),
            ("gelu with a bias", (fused.gelu_fwd, g, "none", b), F.gelu(g + b)),
            ("gelu_bwd transposed", (fused.gelu_bwd, gt, gt, "none"), aten.gelu_backward.default(gt, gt))]


def test_other_layouts_and_broadcasts_run_the_fallback_with_aten_s_values_and_strides() -> None:
    """And give what their fake implementations promise (strides included)."""
    needs_interpreter()
    from torch._subclasses.fake_tensor import FakeTensorMode

    for what, (op, *args), want in op_calls():
        got = op(*args)
        got = got[0] if isinstance(got, tuple) else got
        assert got.shape == want.shape and got.dtype == want.dtype and got.stride() == want.stride(), what
        assert_close_rel(got, want, what)
        with FakeTensorMode(allow_non_fake_inputs=True):
            fake = op(*args)
        fake = fake[0] if isinstance(fake, tuple) else fake
        assert (fake.shape, fake.dtype, fake.stride()) == (got.shape, got.dtype, got.stride()), what


def test_the_fake_implementations_give_aten_s_shapes_dtypes_and_strides() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        g, u = torch.empty(4, 6, 10, dtype=torch.bfloat16), torch.empty(4, 6, 10, dtype=torch.bfloat16)
        x32, b = torch.empty(4, 6, 10), torch.empty(10)
        cases = [(activations.swiglu_fwd(g, u), aten.mul.Tensor(aten.silu.default(g), u)),
                 (activations.swiglu_fwd(g, u, torch.float32), aten.mul.Tensor(aten.silu.default(g), u).float()),
                 (activations.swiglu_bwd(g, g, u)[0], aten.silu_backward.default(aten.mul.Tensor(g, u), g)),
                 (activations.swiglu_bwd(g, g, u)[1], aten.mul.Tensor(g, aten.silu.default(g))),
                 (activations.gelu_fwd(g, "tanh"), aten.gelu.default(g, approximate="tanh")),
                 (activations.gelu_fwd(g, "none", b), aten.gelu.default(aten.add.Tensor(g, b))),
                 (activations.gelu_bwd(g, x32, "none"), aten.gelu_backward.default(g, x32)),
                 (activations.gelu_bwd(g, g, "none", None, torch.float32), aten.gelu_backward.default(g, g).float()),
                 (activations.gelu_fwd(x32.transpose(0, 2), "none"), aten.gelu.default(x32.transpose(0, 2)))]
        for i, (got, want) in enumerate(cases):
            assert (got.shape, got.dtype, got.stride()) == (want.shape, want.dtype, want.stride()), i


# --- the matcher on models ---------------------------------------------------------------------

def tiny_gpt2() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=32, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="sdpa")
    return transformers.GPT2LMHeadModel(cfg)


def tiny_falcon() -> nn.Module:
    """Falcon with biases: FalconLinear adds its bias by a node of its own (`x @ w.T + b`)."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.FalconConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                    bias=True, attn_implementation="sdpa")
    return transformers.FalconForCausalLM(cfg)


def tiny_fxspeed_gpt() -> nn.Module:
    return GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32))


# kind -> (model, ATen ops the fused region must leave none of, fused ops)
MODELS = {"llama": (lambda: tiny_hf("llama"), ("aten.silu.default", "aten.sigmoid.default"), SWIGLU),
          "gpt2": (tiny_gpt2, ("aten.tanh.default", "aten.tanh_backward.default", "aten.pow.Tensor_Scalar"), GELU),
          "gpt": (tiny_fxspeed_gpt, ("aten.gelu.default", "aten.gelu_backward.default"), GELU),
          "falcon": (tiny_falcon, ("aten.gelu.default", "aten.gelu_backward.default"), GELU)}


def fuse_everything(step) -> int:
    """fuse_kernels (norms), then the activations, on a step compiled without either."""
    fuse_in_place(step)
    n = fuse_activations(step.captured.gm.graph, step.captured.module_of)
    step.captured.gm.graph.lint()
    step.captured.gm.recompile()
    return n


def mlp_count(model: nn.Module) -> int:
    return sum(type(m).__name__.endswith(("MLP", "Mlp")) for m in model.modules())


@pytest.mark.parametrize("kind,precision", [("llama", "fp32"), ("llama", "bf16"), ("gpt2", "fp32"), ("gpt2", "bf16"),
                                            ("gpt", "fp32"), ("falcon", "bf16")])
def test_each_mlp_s_activation_becomes_one_fused_pair_with_the_same_loss_and_gradients(kind, precision) -> None:
    """HF Llama (SwiGLU), HF GPT-2 (written-out tanh GELU), fxspeed's GPT (aten.gelu), HF Falcon
    (a bias add, then aten.gelu): no ATen op of the region is left, one fused forward and one
    fused backward per MLP, the step's loss and gradients those of the unfused program."""
    make, gone, fused_ops = MODELS[kind]
    model = make()
    layers = mlp_count(model)
    assert layers == 2
    args, kwargs = ((torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))), {}) if kind == "gpt" \
        else ((), hf_batches(1)[0])
    step = compile_step(model, args, kwargs, config=fxspeed.Config(precision=precision, disable_passes=UNFUSED),
                        loss_fn=None)
    inputs = step_inputs(step, model, args, kwargs)
    plain = run_step(step.captured.gm, inputs)
    fuse_in_place(step)
    before = count_targets(step.captured.gm)
    assert fuse_activations(step.captured.gm.graph, step.captured.module_of) == layers  # one region per MLP
    step.captured.gm.recompile()
    counts = count_targets(step.captured.gm)
    assert not any(counts.get(t) for t in gone), counts
    assert [counts.get(t, 0) for t in fused_ops] == [layers, layers], counts
    fused = run_step(step.captured.gm, inputs)
    names = ["loss", *(s.target for s in step.captured.signature.outputs[1:])]
    for name, a, b in zip(names, fused, plain, strict=True):
        assert_close_rel(a, b, name, 1e-5 if precision == "fp32" else 2e-2)
    graph = step.captured.gm.graph
    forwards = [n for n in graph.nodes if str(n.target) == fused_ops[0]]
    for i, n in enumerate(forwards):  # the fused forward stands for the MLP's activation: its module, its trace
        assert f".{i}." in n.meta[META_KEY].module and n.meta.get("stack_trace"), (n.name, n.meta[META_KEY].module)
    if kind == "falcon":  # the bias add is gone into the fused ops, which read the bias
        assert counts["aten.add.Tensor"] == before["aten.add.Tensor"] - layers
        assert all(n.args[2] is not None and n.args[2].op == "placeholder" for n in forwards)


@pytest.fixture
def activation_fusion(monkeypatch) -> None:
    """The fusion passes (fuse_activations among them) on CPU programs."""
    monkeypatch.setenv("FXSPEED_FUSE_ON_CPU", "1")


def test_training_through_fxspeed_compile_with_fused_activations_matches_eager(activation_fusion,
                                                                               monkeypatch) -> None:
    """Three AdamW steps of HF Llama through fxspeed.compile, the fused ops in its program: losses
    and updated parameters equal eager's. Here the ops run their torch fallback; in the
    interpreted run, the Triton kernels."""
    calls = []
    on_kernel = activations._on_kernel
    monkeypatch.setattr(activations, "_on_kernel", lambda *a, **k: calls.append(1) or on_kernel(*a, **k))
    engine, _ = check_parity(tiny_hf("llama", layers=1), hf_batches(), fxspeed.Config(optimizer="adamw", lr=1e-3))
    assert any(p["name"] == "fuse_kernels" and p["modified"] for p in engine.plan.passes)
    assert len(calls) >= 3 * 2, "every step ran the fused forward and backward"
    if INTERPRETING and triton_available():
        assert activations._make_kernels.cache_info().currsize == 1, "the steps ran the Triton kernels"


def test_the_planner_sees_no_higher_peak_with_fused_activations(activation_fusion, monkeypatch) -> None:
    """The fused backward makes two values, and backward keeps g and u either way
    (recompute_pointwise recomputes silu(g) u from them). The unfused one made nine (sigmoid,
    1 - sigmoid, ...) until normalize_graph gave SiLU's gradient its one op back; now the two
    plan the same peak, and fusion must not plan a higher one."""
    model, batch = tiny_hf("llama", layers=1), hf_batches(1)[0]

    def planned(disable: tuple[str, ...] = ()) -> fxspeed.Plan:
        return fxspeed.plan(model, 1, fxspeed.Config(disable_passes=disable), example_inputs=batch)

    fused, unfused = planned(), planned(("fuse_activations",))
    assert fused.peak_memory(0) <= unfused.peak_memory(0)


# --- the matcher on small nets: exact forms only -----------------------------------------------

class Activation(nn.Module):
    """Linear -> an activation of `form` -> Linear. Fused forms: swiglu, swiglu_up_first, gelu_new,
    gelu, gelu_tanh, bias_gelu (the bias folded in), row_bias_gelu (the gelu alone: its bias is not
    1-D over the last dim). Left alone: silu_read_twice (silu(g) has a reader outside),
    gelu_new_wrong_constant (Bloom's 0.79788456 for sqrt(2/pi)), gelu_new_wrong_cubic, silu_alone."""

    def __init__(self, form: str, n: int, rows: int) -> None:
        super().__init__()
        self.form = form
        self.gate, self.up, self.down = nn.Linear(8, n, bias=False), nn.Linear(8, n), nn.Linear(n, 4)
        self.bias = nn.Parameter(torch.randn(n))
        self.row_bias = nn.Parameter(torch.randn(rows, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, f = self.gate(x), self.form
        if f == "swiglu":
            y = F.silu(h) * self.up(x)
        elif f == "swiglu_up_first":
            y = self.up(x) * F.silu(h)
        elif f == "silu_read_twice":
            s = F.silu(h)
            y = s * self.up(x) + s
        elif f == "silu_alone":
            y = F.silu(h)
        elif f.startswith("gelu_new"):
            k = 0.79788456 if f == "gelu_new_wrong_constant" else math.sqrt(2.0 / math.pi)
            c = 0.044 if f == "gelu_new_wrong_cubic" else 0.044715
            y = 0.5 * h * (1.0 + torch.tanh(k * (h + c * torch.pow(h, 3.0))))
        elif f == "bias_gelu":
            y = F.gelu(h + self.bias)
        elif f == "row_bias_gelu":
            y = F.gelu(h + self.row_bias)
        else:
            y = F.gelu(h, approximate="tanh" if f == "gelu_tanh" else "none")
        return self.down(y).pow(2).mean()


class ActivationNet(nn.Module):
    """The sum of the losses of one `Activation` per form, all reading the same input."""

    def __init__(self, forms: list[str], n: int, rows: int) -> None:
        super().__init__()
        self.branches = nn.ModuleList(Activation(f, n, rows) for f in forms)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(b(x) for b in self.branches)


FUSED = {"swiglu": SWIGLU, "swiglu_up_first": SWIGLU, "gelu_new": GELU, "gelu": GELU, "gelu_tanh": GELU,
         "bias_gelu": GELU, "row_bias_gelu": GELU}
# near misses -> the ATen ops each leaves in the graph (its anchor, forward and backward)
LEFT = {"silu_read_twice": {"aten.silu.default": 1}, "silu_alone": {"aten.silu.default": 1},
        "gelu_new_wrong_constant": {"aten.tanh.default": 1, "aten.tanh_backward.default": 1},
        "gelu_new_wrong_cubic": {"aten.tanh.default": 1, "aten.tanh_backward.default": 1}}


@settings(max_examples=4, deadline=None, derandomize=True)
@given(forms=st.lists(st.sampled_from([*FUSED, *LEFT]), min_size=1, max_size=3),
       precision=st.sampled_from(["fp32", "bf16"]), lead=st.sampled_from([(6,), (2, 3)]), n=st.sampled_from([1, 16]))
@example(forms=list(FUSED), precision="bf16", lead=(2, 3), n=16)
@example(forms=list(LEFT), precision="fp32", lead=(6,), n=16)
def test_activations_are_fused_exactly_in_their_forms_and_compute_the_same(forms, precision, lead, n) -> None:
    """Random small nets: the fused program gives the unfused program's loss and gradients;
    every activation of an exact form is one fused pair, and near misses (a reader outside the
    region, another constant, a bias of another broadcast) are left as they were."""
    torch.manual_seed(0)
    model, x = ActivationNet(forms, n, lead[-1]), torch.randn(*lead, 8)
    step = compile_step(model, (x,), {}, config=fxspeed.Config(precision=precision, disable_passes=UNFUSED),
                        loss_fn=None)
    inputs = step_inputs(step, model, (x,), {})
    before = count_targets(step.captured.gm)
    plain = run_step(step.captured.gm, inputs)
    regions = fuse_activations(step.captured.gm.graph, dict(step.captured.module_of))
    step.captured.gm.graph.lint()
    step.captured.gm.recompile()
    after = count_targets(step.captured.gm)
    fused = [f for f in forms if f in FUSED]
    assert regions == len(fused)
    for ops in (SWIGLU, GELU):
        assert [after.get(t, 0) for t in ops] == [sum(FUSED[f] == ops for f in fused)] * 2, after
    left = {op: sum(LEFT.get(f, {}).get(op, 0) for f in forms) for op in ("aten.silu.default", "aten.tanh.default",
                                                                          "aten.tanh_backward.default")}
    assert {op: after.get(op, 0) for op in left} == left, after
    # the bias add folded into the fused ops; one of another broadcast stays
    assert after.get("aten.add.Tensor", 0) == before.get("aten.add.Tensor", 0) - forms.count("bias_gelu") \
        - 4 * forms.count("gelu_new"), after  # gelu_new: 2 adds forward, 2 in its backward
    if not fused:
        assert after == before, "a form that is not matched was rewritten"
    outputs = run_step(step.captured.gm, inputs)
    names = ["loss", *(s.target for s in step.captured.signature.outputs[1:])]
    for name, a, b in zip(names, outputs, plain, strict=True):
        assert_close_rel(a, b, name, 1e-5 if precision == "fp32" else 2e-2)


def test_a_forward_without_backward_is_fused_alone() -> None:
    """An inference program (and a checkpointed layer's first forward) has no backward: SwiGLU
    and the written-out GELU are fused as forwards; the outputs are the same."""
    x = torch.randn(6, 8)
    for form in ("swiglu", "gelu_new", "bias_gelu"):
        model = Activation(form, 16, 6).eval()
        step = compile_step(model, (x,), {}, config=fxspeed.Config(disable_passes=UNFUSED), loss_fn=None, train=False)
        inputs = step_inputs(step, model, (x,), {})
        plain = step.captured.gm(*inputs)
        assert [(m.kind, m.backward_args) for m in find_activations(step.captured.gm.graph)] == \
            [("swiglu" if form == "swiglu" else "gelu", None)]
        assert fuse_activations(step.captured.gm.graph, dict(step.captured.module_of)) == 1
        step.captured.gm.recompile()
        counts = count_targets(step.captured.gm)
        ops = SWIGLU if form == "swiglu" else GELU
        assert [counts.get(t, 0) for t in ops] == [1, 0], counts
        assert not {"aten.silu.default", "aten.tanh.default", "aten.add.Tensor"} & counts.keys(), counts
        for a, b in zip(step.captured.gm(*inputs), plain, strict=True):
            assert_close_rel(a, b, form, 1e-5)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_a_checkpointed_layer_s_activation_is_fused_in_its_forward_and_in_its_recomputation(kind) -> None:
    """HF gradient checkpointing in bf16: the layer's first forward has no backward, and its
    recomputation in backward has no forward product (backward reads silu(g) / tanh, not their
    product, and the down projection's weight gradient reads the first forward's bf16 copy):
    fused as a forward alone and a backward alone; the step is unchanged."""
    make, gone, fused_ops = MODELS[kind]
    model = tiny_hf("llama", layers=1) if kind == "llama" else make()
    model.gradient_checkpointing_enable()
    model.train()
    batch = hf_batches(1)[0]
    step = compile_step(model, (), batch, config=fxspeed.Config(precision="bf16", disable_passes=UNFUSED), loss_fn=None)
    inputs = step_inputs(step, model, (), batch)
    plain = run_step(step.captured.gm, inputs)
    fuse_everything(step)
    counts = count_targets(step.captured.gm)
    layers = mlp_count(model)
    assert not any(counts.get(t) for t in gone) and [counts.get(t, 0) for t in fused_ops] == [layers, layers], counts
    for a, b in zip(run_step(step.captured.gm, inputs), plain, strict=True):
        assert_close_rel(a, b, "checkpointed step output", 2e-2)


def test_silu_backward_as_one_op_is_matched_too() -> None:
    """aten.silu_backward (a composite: captures hold its formula) where a graph has it as one
    node; the forward product is told from up's gradient by graph order."""
    g = torch.fx.Graph()
    gate, up, dy = g.placeholder("gate"), g.placeholder("up"), g.placeholder("dy")
    s = g.call_function(aten.silu.default, (gate,))
    y = g.call_function(aten.mul.Tensor, (up, s))
    gu = g.call_function(aten.mul.Tensor, (s, dy))
    dsu = g.call_function(aten.mul.Tensor, (up, dy))
    gg = g.call_function(aten.silu_backward.default, (dsu, gate))
    g.output((y, gg, gu))
    vals = [torch.randn(3, 5) for _ in range(3)]
    for ph, v in zip((gate, up, dy), vals):
        ph.meta["val"] = v
    for n in (s, y, gu, dsu, gg):
        n.meta["val"] = n.target(*torch.fx.node.map_arg(n.args, lambda a: a.meta["val"]))
    gm = torch.fx.GraphModule(nn.Module(), g)
    ref = gm(*vals)
    assert fuse_activations(g, {}) == 1
    gm.recompile()
    assert [str(n.target) for n in g.nodes if n.op == "call_function"] == \
        [SWIGLU[0], SWIGLU[1], str(operator.getitem), str(operator.getitem)]
    for a, b, what in zip(gm(*vals), ref, ("out", "grad_gate", "grad_up"), strict=True):
        assert_close_rel(a, b, what)


# --- the cuda tier ----------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the cuda tier needs a CUDA device")
@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("shape", [(1,), (37, 300), (8, 512, 1376), (3, 4096, 11008)])
def test_the_compiled_activation_kernels_match_torch_on_cuda(shape, dtype) -> None:
    needs_compiled_kernels()
    dt = DTYPES[dtype]
    g, u, dy = (t.cuda() for t in random_inputs(list(shape), dt, 3))
    b = torch.randn(shape[-1], device="cuda").to(dt)
    assert use_triton(g, u, dy, b)
    g64, u64 = g.double().requires_grad_(), u.double().requires_grad_()
    ref = F.silu(g64) * u64
    ref_gg, ref_gu = torch.autograd.grad(ref, [g64, u64], dy.double())
    grad_gate, grad_up = activations.swiglu_bwd(dy, g, u)
    for what, got, want in (("swiglu", activations.swiglu_fwd(g, u), ref), ("grad_gate", grad_gate, ref_gg),
                            ("grad_up", grad_up, ref_gu)):
        matches_reference(got, want, what)
    for approximate in ("none", "tanh"):
        h = (g.double() + b.double()).requires_grad_()
        ref = F.gelu(h, approximate=approximate)
        matches_reference(activations.gelu_fwd(g, approximate, b), ref, f"gelu {approximate}")
        matches_reference(activations.gelu_bwd(dy, g, approximate, b), torch.autograd.grad(ref, [h], dy.double())[0],
                          f"gelu_bwd {approximate}")
    assert activations._make_kernels.cache_info().currsize == 1


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the cuda tier needs a CUDA device")
def test_on_cuda_hf_llama_trains_with_the_fused_swiglu_like_eager(monkeypatch) -> None:
    needs_compiled_kernels()
    monkeypatch.delenv("FXSPEED_FUSE_ON_CPU", raising=False)
    model = tiny_hf("llama", layers=1).cuda()
    batches = [{k: v.cuda() for k, v in b.items()} for b in hf_batches()]
    check_parity(model, batches, fxspeed.Config(optimizer="adamw", lr=1e-3), rtol=1e-4)
    assert activations._make_kernels.cache_info().currsize == 1, "the steps ran the compiled kernels"
