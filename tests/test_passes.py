"""Each rewrite pass on small graphs, and dedupe_tied_parameters end to end on a tied GPT."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
from torch.fx.experimental.proxy_tensor import make_fx

import fxspeed
from fxspeed.compiler.annotate import make_annotate_pass
from fxspeed.compiler.capture import capture_step
from fxspeed.ir import IOSpec, StepSignature
from fxspeed.models import GPT, GPTConfig
from fxspeed.compiler.pass_manager import PassContext, PassManager, verify
from fxspeed.passes import (ALL_PASSES, dedupe_tied_parameters, default_pipeline, eliminate_dead_code,
                            normalize_graph)

aten = torch.ops.aten


def run_pass(p, gm: fx.GraphModule, sig: StepSignature) -> fx.GraphModule:
    return PassManager([p], analyses=[make_annotate_pass()]).run(gm, PassContext(signature=sig))


def targets(gm: fx.GraphModule) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def plain_signature(gm: fx.GraphModule) -> StepSignature:
    n_in = sum(n.op == "placeholder" for n in gm.graph.nodes)
    n_out = len(next(n for n in gm.graph.nodes if n.op == "output").args[0])
    return StepSignature([IOSpec("input", str(i)) for i in range(n_in)],
                         [IOSpec("output", str(i)) for i in range(n_out)])


# ------------------------------------------------------------------------------------------
# eliminate_dead_code
# ------------------------------------------------------------------------------------------

def _with_dead_code(x: torch.Tensor, buf: torch.Tensor) -> tuple[torch.Tensor]:
    aten.bernoulli.p(x, 0.5)  # unused random draw
    aten.native_dropout.default(x, 0.5, True)  # unused dropout (and its getitems)
    aten.add_.Tensor(buf, 1)  # unused in-place update
    t = aten.t.default(aten.mul.Tensor(x, 3))  # unused pure chain
    aten.sum.default(t)
    return (aten.relu.default(x),)


def test_dead_code_elimination_removes_unused_pure_nodes_including_whole_chains():
    gm = make_fx(_with_dead_code)(torch.randn(3, 3), torch.zeros(3, 3))
    gm = run_pass(eliminate_dead_code, gm, plain_signature(gm))
    left = targets(gm)
    assert aten.mul.Tensor not in left and aten.t.default not in left and aten.sum.default not in left
    assert aten.relu.default in left


def test_dead_code_elimination_keeps_unused_random_ops_so_the_rng_stream_matches_eager():
    gm = make_fx(_with_dead_code)(torch.randn(3, 3), torch.zeros(3, 3))
    gm = run_pass(eliminate_dead_code, gm, plain_signature(gm))
    left = targets(gm)
    assert aten.bernoulli.p in left and aten.native_dropout.default in left


def test_dead_code_elimination_keeps_unused_mutating_ops():
    gm = make_fx(_with_dead_code)(torch.randn(3, 3), torch.zeros(3, 3))
    gm = run_pass(eliminate_dead_code, gm, plain_signature(gm))
    assert aten.add_.Tensor in targets(gm)
    buf = torch.zeros(3, 3)
    gm(torch.randn(3, 3), buf)
    assert torch.equal(buf, torch.ones(3, 3))


def test_dead_code_elimination_does_not_change_the_outputs_or_the_random_numbers_drawn_after():
    def f(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        aten.bernoulli.p(x, 0.5)
        aten.exp.default(x)
        return aten.relu.default(x), aten.bernoulli.p(x, 0.5)

    x = torch.randn(4, 4)
    gm = make_fx(f)(x)
    torch.manual_seed(0)
    before = gm(x)
    gm = run_pass(eliminate_dead_code, gm, plain_signature(gm))
    torch.manual_seed(0)
    after = gm(x)
    assert aten.exp.default not in targets(gm)
    assert all(torch.equal(a, b) for a, b in zip(before, after))


def test_dead_code_elimination_reports_unchanged_when_nothing_is_dead():
    gm = make_fx(lambda x: (aten.relu.default(x),))(torch.randn(2))
    pm = PassManager([eliminate_dead_code])
    pm.run(gm, PassContext(signature=plain_signature(gm)))
    assert not pm.records[0].modified


# ------------------------------------------------------------------------------------------
# normalize_graph
# ------------------------------------------------------------------------------------------

def test_normalize_removes_detach_and_alias_and_keeps_the_results():
    def f(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        d = aten.detach.default(x)
        a = aten.alias.default(aten.detach.default(d))
        return aten.mul.Tensor(d, 2), aten.add.Tensor(a, 1)

    x = torch.randn(3, 2)
    gm = make_fx(f)(x)
    before = gm(x)
    gm = run_pass(normalize_graph, gm, plain_signature(gm))
    left = targets(gm)
    assert aten.detach.default not in left and aten.alias.default not in left
    mul = next(n for n in gm.graph.nodes if n.target is aten.mul.Tensor)
    assert mul.args[0].op == "placeholder"
    assert all(torch.equal(a, b) for a, b in zip(before, gm(x)))


def test_normalize_gives_silus_gradient_its_aten_op_and_a_silu_mlp_steps_as_eager_bit_for_bit():
    """The joint trace runs backward with grad mode on, where autograd writes SiLU's gradient as
    its twice-differentiable formula (eight kernels); eager runs `silu_backward`, 1 ulp apart."""
    class MLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(16, 64), nn.Linear(64, 1)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return nn.functional.mse_loss(self.b(nn.functional.silu(self.a(x))).squeeze(-1), y)

    torch.manual_seed(0)
    model, x, y = MLP(), torch.randn(32, 16), torch.randn(32)
    ref = copy.deepcopy(model)
    engine = fxspeed.compile(model, config=fxspeed.Config(optimizer="sgd", lr=1.0), example_inputs=(x, y))
    assert aten.silu_backward.default in targets(engine.graph())
    assert aten.sigmoid.default not in targets(engine.graph())
    engine.train_step(x, y)
    ref(x, y).backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p.detach(), q.detach() - q.grad)


def test_normalize_keeps_an_alias_that_is_a_graph_output_as_its_input():
    def f(x: torch.Tensor) -> tuple[torch.Tensor]:
        return (aten.detach.default(aten.relu.default(x)),)

    x = torch.randn(5)
    gm = make_fx(f)(x)
    gm = run_pass(normalize_graph, gm, plain_signature(gm))
    out = next(n for n in gm.graph.nodes if n.op == "output")
    assert out.args[0][0].target is aten.relu.default
    assert torch.equal(gm(x)[0], torch.relu(x))


# ------------------------------------------------------------------------------------------
# dedupe_tied_parameters
# ------------------------------------------------------------------------------------------

SMALL_GPT = GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16)


def gpt_batch(cfg: GPTConfig, batch: int = 2, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size), generator=g)
    return idx, torch.randint(0, cfg.vocab_size, (batch, cfg.block_size), generator=g)


def feed(model: nn.Module, sig: StepSignature, batch: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    params = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers(remove_duplicate=False))
    return [params[s.target] if s.kind == "param" else buffers[s.target] if s.kind == "buffer"
            else batch[int(s.target)] for s in sig.inputs]


def by_target(sig: StepSignature, outs) -> dict[str, torch.Tensor]:
    return {f"{s.kind}:{s.target}": t for s, t in zip(sig.outputs, outs)}


@pytest.fixture(scope="module")
def gpt_and_batch():
    torch.manual_seed(0)
    return GPT(SMALL_GPT), gpt_batch(SMALL_GPT)


def test_dedupe_feeds_a_tied_weight_once_and_returns_one_summed_gradient(gpt_and_batch):
    model, batch = gpt_and_batch
    cap = capture_step(model, batch, {})
    sig = cap.signature
    assert sig.tied == {"head.weight": "wte.weight"}
    before_sig = copy.deepcopy(sig)
    with torch.no_grad():
        before = by_target(before_sig, cap.gm(*feed(model, sig, batch)))
    gm = run_pass(dedupe_tied_parameters, cap.gm, sig)

    params_in = [s.target for s in sig.inputs if s.kind == "param"]
    grads_out = [s.target for s in sig.outputs if s.kind == "grad"]
    assert "head.weight" not in params_in and params_in.count("wte.weight") == 1
    assert "head.weight" not in grads_out and grads_out.count("wte.weight") == 1
    assert len(sig.inputs) == len(before_sig.inputs) - 1 and len(sig.outputs) == len(before_sig.outputs) - 1
    assert sig.tied == before_sig.tied  # still describes the model
    verify(gm, sig)

    with torch.no_grad():
        after = by_target(sig, gm(*feed(model, sig, batch)))
    assert torch.equal(after["loss:loss"], before["loss:loss"])
    expected = before["grad:wte.weight"] + before["grad:head.weight"]
    torch.testing.assert_close(after["grad:wte.weight"], expected, rtol=0, atol=0)
    for k, v in before.items():
        if k not in ("grad:wte.weight", "grad:head.weight"):
            assert torch.equal(after[k], v), k


def test_dedupe_gives_the_summed_gradient_a_fake_value_of_the_weights_shape(gpt_and_batch):
    model, batch = gpt_and_batch
    cap = capture_step(model, batch, {})
    gm = run_pass(dedupe_tied_parameters, cap.gm, cap.signature)
    out = next(n for n in gm.graph.nodes if n.op == "output")
    i = next(i for i, s in enumerate(cap.signature.outputs) if s == IOSpec("grad", "wte.weight"))
    g = out.args[0][i]
    assert g.target is aten.add.Tensor
    val = g.meta["val"]
    assert isinstance(val, torch._subclasses.fake_tensor.FakeTensor)
    assert val.shape == model.wte.weight.shape and val.dtype == model.wte.weight.dtype


def test_dedupe_of_an_eval_graph_merges_the_inputs_and_keeps_the_logits(gpt_and_batch):
    model, (idx, _) = gpt_and_batch
    cap = capture_step(model, (idx,), {}, train=False)
    with torch.no_grad():
        before = cap.gm(*feed(model, cap.signature, (idx,)))
    gm = run_pass(dedupe_tied_parameters, cap.gm, cap.signature)
    assert "head.weight" not in [s.target for s in cap.signature.inputs]
    with torch.no_grad():
        after = gm(*feed(model, cap.signature, (idx,)))
    assert all(torch.equal(a, b) for a, b in zip(before, after))


def test_dedupe_leaves_a_model_without_tied_weights_untouched():
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    cap = capture_step(model, (torch.randn(3, 4),), {}, loss_fn=lambda out, x: out.mean())
    sig0 = copy.deepcopy(cap.signature)
    n0 = len(cap.gm.graph.nodes)
    pm = PassManager([dedupe_tied_parameters])
    gm = pm.run(cap.gm, PassContext(signature=cap.signature))
    assert not pm.records[0].modified and len(gm.graph.nodes) == n0 and cap.signature == sig0


def test_dedupe_runs_after_normalize_and_before_dead_code_elimination_by_default():
    names = [p.name for p in default_pipeline()]
    assert names.index("normalize_graph") < names.index("dedupe_tied_parameters") < names.index("eliminate_dead_code")
    assert set(names) == set(ALL_PASSES)


def _eager_adamw(model: nn.Module, batches, lr: float) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, fused=True)  # Config default
    losses = []
    for idx, tgt in batches:
        loss = model(idx, tgt)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


@pytest.mark.parametrize("disabled", [(), ("dedupe_tied_parameters",)],
                         ids=["with_dedupe", "without_dedupe"])
def test_training_the_tiny_tied_gpt_for_three_steps_matches_eager_adamw(disabled):
    cfg = GPTConfig.preset("tiny")
    torch.manual_seed(0)
    model = GPT(cfg)
    ref = copy.deepcopy(model)
    batches = [gpt_batch(cfg, batch=2, seed=s) for s in range(3)]
    lr = 1e-3
    engine = fxspeed.compile(model, config=fxspeed.Config(lr=lr, disable_passes=disabled),
                             example_inputs=batches[0])
    sig = next(iter(engine._executors.values())).program.signature
    fed = [s.target for s in sig.inputs if s.kind == "param"]
    assert ("head.weight" in fed) == bool(disabled)
    losses = [engine.train_step(*b) for b in batches]
    ref_losses = _eager_adamw(ref, batches, lr)
    for got, want in zip(losses, ref_losses):
        assert abs(got - want) <= 1e-5 * abs(want)
    assert model.head.weight is model.wte.weight
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert _rel_err(p.detach(), q.detach()) <= 1e-5, name


# ------------------------------------------------------------------------------------------
# shard_parameters (ZeRO-3), rewritten for rank 0 of 2 without running it
# ------------------------------------------------------------------------------------------

def _zero3_graph(**extra):  # noqa: ANN202
    from fxspeed.compiler import PassOptions, compile_step

    torch.manual_seed(0)
    m = GPT(GPTConfig(vocab_size=512, block_size=32, n_layer=4, n_head=2, n_embd=64))
    x, y = torch.randint(0, 512, (2, 16)), torch.randint(0, 512, (2, 16))
    config = fxspeed.Config(zero=3)
    opts = PassOptions.single_device(config, world_size=2, rank=0, zero=3, group_name="unused", bucket_bytes=100_000,
                                     **extra)
    c = compile_step(m, (x, y), {}, config=config, loss_fn=None, options=opts)
    return c.captured.gm, c.captured.signature


def test_zero3_gathers_a_bucket_again_when_its_readers_are_far_apart_instead_of_keeping_it_alive():
    from collections import Counter

    from fxspeed.passes.parallel.shard_parameters import GATHER_KEY

    gm, sig = _zero3_graph(gather_via_all_reduce=True)
    gathers = Counter(n.meta[GATHER_KEY] for n in gm.graph.nodes if GATHER_KEY in n.meta)
    tied = next(b.index for b in sig.buckets if "wte.weight" in b.names)
    # The tied embedding's bucket is read at both ends of forward (embedding, head) and of
    # backward (head's input gradient, first block's norms): two gathers per phase.
    assert gathers[tied] == 4
    assert all(gathers[b.index] == 2 for b in sig.buckets if b.index != tied)
    # gloo: every gather is an in-place all-reduce of the zero-padded shard.
    assert all(n.target is torch.ops._c10d_functional.all_reduce_.default
               for n in gm.graph.nodes if GATHER_KEY in n.meta)


def test_zero3_gathered_and_flattened_buckets_share_a_few_workspaces():
    gm, sig = _zero3_graph(gather_via_all_reduce=True, scatter_via_all_reduce=True)
    workspaces = [n for n in gm.graph.nodes if n.target is aten.empty.memory_format]
    flats = sum(n.target is aten.cat.out for n in gm.graph.nodes)
    assert flats == len(sig.buckets)  # every gradient bucket flattened into a workspace
    assert 2 <= len(workspaces) <= 4  # current + prefetched gather, one gradient bucket (+ a size)
