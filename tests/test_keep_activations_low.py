"""keep_activations_low: values a low-precision matmul makes stay low through the ops that follow
it (autocast's dataflow), and everything else keeps reading fp32."""

from __future__ import annotations

import copy
import operator
from dataclasses import dataclass

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import fxspeed
from fxspeed.compiler import compile_step
from fxspeed.compiler.annotate import make_annotate_pass
from fxspeed.compiler.capture import capture_step
from fxspeed.compiler.options import PassOptions
from fxspeed.compiler.pass_manager import PassContext, PassManager
from fxspeed.ir import BACKWARD, META_KEY
from fxspeed.passes import insert_casts, keep_activations_low
from fxspeed.passes.graph.insert_casts import LOW_OPS, _is_view
from fxspeed.passes.graph.keep_activations_low import _SUMS, FOLLOWING
from tests.test_mixed_precision import LOW, batch, tiny_gpt
from tests.test_properties import feed, outputs_by_meaning

aten = torch.ops.aten


def dtype_of(n: torch.fx.Node) -> torch.dtype | None:
    v = n.meta.get("val")
    return v.dtype if isinstance(v, torch.Tensor) else None


def casts_up(gm: torch.fx.GraphModule) -> int:
    return sum(1 for n in gm.graph.nodes if n.target is aten._to_copy.default and n.kwargs.get("dtype") == torch.float32)


def test_gelu_and_the_attention_views_run_in_bf16_and_layer_norms_still_read_fp32() -> None:
    x, y = batch()
    # (recompute_pointwise off: its clones of GELU in backward would be counted with the originals)
    on = compile_step(tiny_gpt(), (x, y), {}, config=fxspeed.Config(precision="bf16", disable_passes=("recompute_pointwise",)),
                      loss_fn=None)  # the default
    off = compile_step(tiny_gpt(), (x, y), {}, config=fxspeed.Config(precision="bf16", low_activations=False,
                                                                     disable_passes=("recompute_pointwise",)),
                       loss_fn=None)
    assert "keep_activations_low" not in [r.name for r in off.records if r.modified]
    assert any(r.name == "keep_activations_low" and r.modified for r in on.records)
    nodes = [n for n in on.captured.gm.graph.nodes if n.op == "call_function"]
    gelus = [n for n in nodes if n.target in (aten.gelu.default, aten.gelu_backward.default)]
    assert len(gelus) == 4 and all(dtype_of(n) == torch.bfloat16 for n in gelus)
    for n in nodes:
        if n.target in (aten.native_layer_norm.default, aten._log_softmax.default, aten.nll_loss_forward.default):
            assert all(dtype_of(a) in (torch.float32, torch.int64) for a in n.all_input_nodes), n.format_node()
    assert casts_up(on.captured.gm) < casts_up(off.captured.gm)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_training_with_low_activations_tracks_eager_autocast_as_closely_as_before(precision: str) -> None:
    """Eager autocast is the reference: the pass moves fxspeed's numerics toward it."""
    dtype = LOW[precision]
    batches = [batch(i, rows=8) for i in range(4)]
    torch.manual_seed(0)
    eager = tiny_gpt()
    opt = torch.optim.SGD(eager.parameters(), lr=0.1)
    ref = []
    for x, y in batches:
        with torch.autocast("cpu", dtype=dtype):
            loss = eager(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref.append(loss.item())
    errors = {}
    for low in (True, False):
        engine = fxspeed.compile(tiny_gpt(), 1, fxspeed.Config(precision=precision, optimizer="sgd", lr=0.1,
                                                                low_activations=low),
                                 example_inputs=batches[0])
        got = [engine.train_step(x, y) for x, y in batches]
        errors[low] = max(abs(a - b) / abs(b) for a, b in zip(got, ref))
        params = dict(engine.model.named_parameters())
        for name, p in eager.named_parameters():
            torch.testing.assert_close(params[name], p, rtol=0.05, atol=2e-3, msg=lambda m: f"{low} {name}: {m}")
    print(errors)
    assert errors[True] < 1e-2, errors
    assert errors[True] <= 1.5 * errors[False] + 1e-4, errors


def test_hf_llama_s_swiglu_runs_low_and_trains_like_the_graph_without_the_pass() -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                   attn_implementation="sdpa")
    ids = [torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(i)) for i in range(3)]
    losses = {}
    for low in (True, False):
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(cfg)
        config = fxspeed.Config(precision="bf16", low_activations=low)
        engine = fxspeed.compile(model, 1, config, example_inputs={"input_ids": ids[0], "labels": ids[0]})
        losses[low] = [engine.train_step(input_ids=b, labels=b) for b in ids]
        if low:
            nodes = engine.graph().graph.nodes
            silu = [n for n in nodes if n.target in (aten.silu.default, aten.silu_backward.default)]
            assert silu and all(dtype_of(n) == torch.bfloat16 for n in silu)
    torch.testing.assert_close(torch.tensor(losses[True]), torch.tensor(losses[False]), rtol=2e-2, atol=0)


def test_config_low_activations_false_or_disabling_the_pass_by_name_keeps_the_graph_as_insert_casts_left_it() -> None:
    x, y = batch()
    for config in (fxspeed.Config(precision="bf16", low_activations=False),
                   fxspeed.Config(precision="bf16", low_activations=True, disable_passes=("keep_activations_low",))):
        step = compile_step(tiny_gpt(), (x, y), {}, config=config, loss_fn=None)
        gelu = next(n for n in step.captured.gm.graph.nodes if n.target is aten.gelu.default)
        assert dtype_of(gelu) == torch.float32
    assert PassOptions.single_device(fxspeed.Config(precision="bf16")).low_activations == "always"
    with pytest.raises(fxspeed.ConfigError, match="low_activations"):
        fxspeed.Config(low_activations="yes")


# --- property: random models, the pass alone after insert_casts --------------------------------

ACTS = {"relu": F.relu, "gelu": F.gelu, "silu": F.silu, "tanh": torch.tanh, "sigmoid": torch.sigmoid}


@dataclass(frozen=True)
class Spec:
    depth: int
    width: int
    activation: str
    gated: bool       # act(a(x)) * b(x), Llama's MLP
    residual: bool
    layernorm: bool
    transpose: bool   # a view chain between the matmuls
    precision: str
    seed: int


class RandomNet(nn.Module):
    def __init__(self, s: Spec) -> None:
        super().__init__()
        self.s = s
        self.act = ACTS[s.activation]
        self.a = nn.ModuleList(nn.Linear(s.width, s.width) for _ in range(s.depth))
        self.b = nn.ModuleList(nn.Linear(s.width, s.width, bias=False) for _ in range(s.depth))
        self.norms = nn.ModuleList(nn.LayerNorm(s.width) for _ in range(s.depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in range(self.s.depth):
            h = self.norms[i](x) if self.s.layernorm else x
            g = self.act(self.a[i](h))
            if self.s.gated:
                g = g * self.b[i](h)
            if self.s.transpose:
                g = g.transpose(0, 1).contiguous().transpose(0, 1) * 0.5
            x = x + g if self.s.residual else g
        return x.pow(2).mean()


nets = st.builds(Spec, depth=st.integers(1, 3), width=st.integers(4, 24), activation=st.sampled_from(sorted(ACTS)),
                 gated=st.booleans(), residual=st.booleans(), layernorm=st.booleans(), transpose=st.booleans(),
                 precision=st.sampled_from(["bf16", "fp16"]), seed=st.integers(0, 2**16))


def _apply(gm: torch.fx.GraphModule, sig, module_of: dict, passes: list, precision: str) -> torch.fx.GraphModule:
    options = PassOptions(precision=precision, low_activations="always")
    return PassManager(passes, analyses=[make_annotate_pass()]).run(
        gm, PassContext(signature=sig, module_of=dict(module_of), options=options))


@settings(max_examples=25, deadline=None, derandomize=True, phases=[Phase.explicit, Phase.generate],
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(nets)
def test_on_random_networks_only_following_ops_turn_low_outputs_keep_their_dtypes_and_values_stay_close(s: Spec) -> None:
    torch.manual_seed(s.seed)
    model = RandomNet(s)
    x = torch.randn(6, s.width)
    cap = capture_step(model, (x,), {})
    low = LOW[s.precision]
    gm0, sig0 = copy.deepcopy((cap.gm, cap.signature))
    gm0 = _apply(gm0, sig0, cap.module_of, [insert_casts], s.precision)
    dtypes0 = {n.name: dtype_of(n) for n in gm0.graph.nodes}
    gm1, sig1 = copy.deepcopy((gm0, sig0))
    gm1 = _apply(gm1, sig1, cap.module_of, [keep_activations_low], s.precision)
    gm1.graph.lint()
    made = {n for n in gm1.graph.nodes if n.op == "call_function" and (
        n.target in LOW_OPS or (n.target is operator.getitem and n.args[0].target in LOW_OPS))}
    turned = 0
    for n in gm1.graph.nodes:
        if n.op != "call_function" or n.name not in dtypes0:
            continue
        if dtypes0[n.name] == torch.float32 and dtype_of(n) == low:
            turned += 1
            # turned low: a following op (or view) whose floating inputs are all low
            assert n.target in FOLLOWING or _is_view(n), n.format_node()
            assert all(dtype_of(a) in (low, torch.bool, None) for a in n.all_input_nodes), n.format_node()
            inf = n.meta.get(META_KEY)
            assert not (n.target in _SUMS and inf is not None and inf.role == BACKWARD), n.format_node()
            made.add(n)
        elif n.target not in FOLLOWING and not _is_view(n) and n.target is not aten._to_copy.default \
                and n.target not in LOW_OPS:
            # any other op reads what it read before: fp32 stays fp32
            for a in n.all_input_nodes:
                if a.name in dtypes0 and dtypes0[a.name] == torch.float32:
                    assert dtype_of(a) == torch.float32, (n.format_node(), a.format_node())
    assert turned, "every network has an activation after a Linear: it runs low"
    out0 = [dtype_of(a) if isinstance(a, torch.fx.Node) else None for a in next(iter(reversed(gm0.graph.nodes))).args[0]]
    out1 = [dtype_of(a) if isinstance(a, torch.fx.Node) else None for a in next(iter(reversed(gm1.graph.nodes))).args[0]]
    assert out0 == out1
    assert casts_up(gm1) <= casts_up(gm0)
    with torch.no_grad():
        want = outputs_by_meaning(sig0, gm0(*feed(model, sig0, [x])))
        got = outputs_by_meaning(sig1, gm1(*feed(model, sig1, [x])))
    assert got.keys() == want.keys()
    for key, w in want.items():
        # the same values where nothing ran low in backward; else one rounding per low op
        torch.testing.assert_close(got[key], w, rtol=3e-2, atol=3e-2 * float(w.abs().max()) + 1e-6,
                                   msg=lambda m: f"{key}: {m}")
