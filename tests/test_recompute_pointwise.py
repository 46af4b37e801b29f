"""recompute_pointwise: elementwise values backward reads are recomputed there from values it
keeps anyway; training is bit for bit the same and fewer bytes live from forward to backward."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import fxspeed
from fxspeed.compiler import compile_step
from fxspeed.compiler.capture import capture_step
from fxspeed.compiler.annotate import make_annotate_pass
from fxspeed.compiler.options import PassOptions
from fxspeed.compiler.pass_manager import PassContext, PassManager
from fxspeed.ir import FORWARD, META_KEY
from fxspeed.passes import insert_casts, keep_activations_low
from fxspeed.passes.memory.recompute_checkpointed import CASTS
from fxspeed.passes.memory.recompute_pointwise import recompute_pointwise
from tests.test_keep_activations_low import RandomNet, Spec, nets
from tests.test_mixed_precision import batch, tiny_gpt
from tests.test_properties import feed, outputs_by_meaning

aten = torch.ops.aten
OFF = ("recompute_pointwise",)


def _train(model: nn.Module, example: dict | tuple, steps: int, **cfg: object) -> tuple[list[float], list[torch.Tensor],
                                                                                         fxspeed.Engine]:
    kw = example if isinstance(example, dict) else None
    engine = fxspeed.compile(model, 1, fxspeed.Config(optimizer="adamw", lr=1e-3, **cfg), example_inputs=example)
    losses = [float(engine.train_step(**kw) if kw else engine.train_step(*example)) for _ in range(steps)]
    return losses, [p.detach().clone() for p in model.parameters()], engine


def _recomputed(engine: fxspeed.Engine) -> list[torch.fx.Node]:
    return [n for n in engine.graph().graph.nodes if "recomputed_pointwise" in n.meta]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_gpt_recomputes_gelu_in_backward_and_trains_bit_for_bit_with_fewer_activation_bytes(precision: str) -> None:
    x, y = batch()
    model = tiny_gpt()
    on = _train(copy.deepcopy(model), (x, y), 3, precision=precision)
    off = _train(copy.deepcopy(model), (x, y), 3, precision=precision, disable_passes=OFF)
    assert on[0] == off[0] and all(torch.equal(a, b) for a, b in zip(on[1], off[1]))
    again = _recomputed(on[2])
    assert any(n.target is aten.gelu.default for n in again) and not _recomputed(off[2])
    assert all(n.meta[META_KEY].role != FORWARD for n in again)
    assert on[2].plan.memory(0)["activations"] < off[2].plan.memory(0)["activations"]


def test_hf_llama_recomputes_silu_and_the_gate_product_and_trains_bit_for_bit() -> None:
    transformers = pytest.importorskip("transformers")
    warnings.filterwarnings("ignore", module="transformers")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64))
    ids = torch.randint(0, 128, (32, 4)).t()  # a non-contiguous batch
    example = {"input_ids": ids, "labels": ids}
    on = _train(copy.deepcopy(model), example, 3, precision="bf16")
    off = _train(copy.deepcopy(model), example, 3, precision="bf16", disable_passes=OFF)
    assert on[0] == off[0] and all(torch.equal(a, b) for a, b in zip(on[1], off[1]))
    targets = {n.target for n in _recomputed(on[2])}
    assert aten.silu.default in targets and aten.mul.Tensor in targets
    assert on[2].plan.peak_memory(0) < off[2].plan.peak_memory(0)


def test_dropout_masks_are_never_recomputed_and_a_model_with_dropout_still_trains_bit_for_bit() -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4,
                                                                 n_positions=64, resid_pdrop=0.2, attn_pdrop=0.2,
                                                                 embd_pdrop=0.2))
    ids = torch.randint(0, 128, (4, 32))
    example = {"input_ids": ids, "labels": ids}
    torch.manual_seed(5)
    on = _train(copy.deepcopy(model), example, 2)
    torch.manual_seed(5)
    off = _train(copy.deepcopy(model), example, 2, disable_passes=OFF)
    assert on[0] == off[0] and all(torch.equal(a, b) for a, b in zip(on[1], off[1]))
    again = _recomputed(on[2])
    assert again and not any("dropout" in str(n.target) or "rand" in str(n.target) for n in again)


def test_the_pass_is_recorded_on_training_programs_and_can_be_disabled_by_name() -> None:
    x, y = batch()
    step = compile_step(tiny_gpt(), (x, y), {}, config=fxspeed.Config(), loss_fn=None)
    assert any(r.name == "recompute_pointwise" and r.modified for r in step.records)
    off = compile_step(tiny_gpt(), (x, y), {}, config=fxspeed.Config(disable_passes=OFF), loss_fn=None)
    assert not any("recomputed_pointwise" in n.meta for n in off.captured.gm.graph.nodes)


# --- property: random models, the pass alone ------------------------------------------------

def _run(gm: torch.fx.GraphModule, sig: object, module_of: dict, passes: list, precision: str,
         pipeline: int = 1) -> torch.fx.GraphModule:
    """`passes` under a pass manager, the graph annotated after (node roles for the checks)."""
    ctx = PassContext(signature=sig, module_of=dict(module_of),
                      options=PassOptions(precision=precision, low_activations="always", pipeline=pipeline))
    pm = PassManager(passes, analyses=[make_annotate_pass()])
    return pm.ensure("annotate", pm.run(gm, ctx), ctx)


@settings(max_examples=25, deadline=None, derandomize=True, phases=[Phase.explicit, Phase.generate],
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(nets, st.sampled_from(["fp32", "bf16"]), st.sampled_from([1, 2]))
def test_on_random_networks_clones_read_only_kept_values_originals_leave_backward_and_outputs_are_bit_for_bit(
        s: Spec, precision: str, pipeline: int) -> None:
    """Under a pipeline (pipeline=2) a cast may also read a weight: the bf16 twin of an fp32 weight
    is cast again in backward instead of being kept per micro-batch in flight."""
    torch.manual_seed(s.seed)
    model = RandomNet(s)
    x = torch.randn(6, s.width)
    cap = capture_step(model, (x,), {})
    gm0, sig0 = copy.deepcopy((cap.gm, cap.signature))
    gm0 = _run(gm0, sig0, cap.module_of, [insert_casts, keep_activations_low], precision)
    before = {n.name: n for n in gm0.graph.nodes}
    forward0 = {n.name for n in gm0.graph.nodes if n.meta.get(META_KEY) is not None and n.meta[META_KEY].role == FORWARD}

    def read_by_backward(name: str) -> bool:
        return any(u.name not in forward0 and u.op != "output" for u in before[name].users)

    gm1, sig1 = copy.deepcopy((gm0, sig0))
    gm1 = _run(gm1, sig1, cap.module_of, [recompute_pointwise], precision, pipeline)
    weights = {ph.name for spec, ph in zip(sig1.inputs, [n for n in gm1.graph.nodes if n.op == "placeholder"])
               if spec.kind == "param"}
    gm1.graph.lint()
    clones = [n for n in gm1.graph.nodes if "recomputed_pointwise" in n.meta]
    names = {n.name for n in clones}
    for c in clones:
        for a in c.all_input_nodes:  # reads another clone, or a value backward read before the pass
            twin = pipeline > 1 and a.name in weights and c.target in CASTS  # (or a stage's weight)
            assert a.name in names or read_by_backward(a.name) or twin, (c.format_node(), a.format_node())
    if pipeline > 1 and precision == "bf16":  # no weight's bf16 twin is kept from forward to backward
        for n in gm1.graph.nodes:
            if n.target in CASTS and n.all_input_nodes and n.all_input_nodes[0].name in weights and n.name in forward0:
                assert not any(u.name not in forward0 and u.op != "output" for u in n.users), n.format_node()
        orig = next((n for n in gm1.graph.nodes if n.name == c.meta["recomputed_pointwise"]), None)
        if orig is not None:  # the original is read in forward only now
            assert all(u.name in forward0 or u in clones for u in orig.users), orig.format_node()
    if s.activation in ("gelu", "silu") and precision == "fp32" and (s.gated or not (s.residual or s.transpose)):
        # their backward reads their input, so their output, where a backward reads it (the gate
        # product's, the next matmul's or the loss's), is recomputed; tanh/sigmoid backward reads
        # the output itself, and a residual sum or a transposed copy is what later layers read
        assert clones, "an fp32 GELU/SiLU whose input backward keeps is recomputed"
    with torch.no_grad():
        want = outputs_by_meaning(sig0, gm0(*feed(model, sig0, [x])))
        got = outputs_by_meaning(sig1, gm1(*feed(model, sig1, [x])))
    assert got.keys() == want.keys()
    for key, w in want.items():
        assert torch.equal(got[key], w), key
