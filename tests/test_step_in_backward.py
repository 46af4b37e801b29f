"""The optimizer step inside backward (passes/memory/step_in_backward.py): bit for bit the
step at the end, never reading a parameter after updating it, and only where that holds."""

from __future__ import annotations

import copy
import operator

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
from hypothesis import given
from hypothesis import strategies as st

import fxspeed
from fxspeed.compiler.options import steps_in_backward
from fxspeed.compiler.pass_manager import PassContext
from fxspeed.errors import FxspeedError
from fxspeed.ir import IOSpec, StepSignature
from fxspeed.models import GPT, GPTConfig
from fxspeed.passes import step_in_backward
from fxspeed.passes.memory.reuse_buffers import is_collective
from fxspeed.runtime.step_in_backward import step_buckets_op, step_parameters_op
from tests.test_properties import SETTINGS, Spec, make, specs

OFF = ("step_in_backward",)


def gpt() -> tuple[GPT, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, n_layer=2, n_head=2, n_embd=64, block_size=32))
    x = torch.randint(0, 256, (4, 32))
    return model, (x, torch.roll(x, 1, 1))


def train(model: nn.Module, batches: list[tuple], steps: int = 3, **config) -> tuple[fxspeed.Engine, list[float]]:
    engine = fxspeed.compile(model, 1, fxspeed.Config(**config), example_inputs=batches[0])
    return engine, [engine.train_step(*batches[i % len(batches)]) for i in range(steps)]


def program(engine: fxspeed.Engine):  # noqa: ANN201
    return next(iter(engine._executors.values())).program


def states(engine: fxspeed.Engine) -> list[torch.Tensor]:
    return [t for s in engine.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]


def assert_same_training(a: nn.Module, b: nn.Module, ea: fxspeed.Engine, eb: fxspeed.Engine) -> None:
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), name
    sa, sb = states(ea), states(eb)
    assert len(sa) == len(sb) and all(torch.equal(x, y) for x, y in zip(sa, sb))


@pytest.mark.parametrize("config", [dict(optimizer="adamw", lr=1e-3, weight_decay=0.1),
                                    dict(optimizer="adam", lr=1e-3, weight_decay=0.1, precision="bf16"),
                                    dict(optimizer="sgd", lr=1e-2, momentum=0.9, lr_schedule="linear",
                                         warmup_steps=1, total_steps=4)],
                         ids=["adamw", "adam-bf16", "sgd-momentum-schedule"])
def test_stepping_inside_backward_trains_bit_for_bit_like_one_step_at_the_end(config):
    model, batch = gpt()
    ref = copy.deepcopy(model)
    engine, losses = train(model, [batch], **config)
    ref_engine, ref_losses = train(ref, [batch], **config, disable_passes=OFF)
    sig = program(engine).signature
    assert len(sig.stepped_in_backward) == sum(1 for p in model.parameters() if p.requires_grad)
    assert not [s for s in sig.outputs if s.kind == "grad"]  # every gradient stepped, none returned
    assert engine._in_backward.calls >= 3 and program(ref_engine).signature.stepped_in_backward == []
    assert losses == ref_losses
    assert_same_training(model, ref, engine, ref_engine)


def test_a_hugging_face_model_steps_inside_backward_bit_for_bit():
    transformers = pytest.importorskip("transformers")  # an HF loss, GQA, RoPE, a tied-free head
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    ref = copy.deepcopy(model)
    batches = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 128, (2, 2, 16))]

    def run(m: nn.Module, off: tuple) -> tuple[fxspeed.Engine, list[float]]:
        e = fxspeed.compile(m, 1, fxspeed.Config(lr=1e-3, disable_passes=off), example_inputs=batches[0])
        return e, [e.train_step(**b) for b in batches]

    (e1, l1), (e2, l2) = run(model, ()), run(ref, OFF)
    assert program(e1).signature.stepped_in_backward and l1 == l2
    assert_same_training(model, ref, e1, e2)


@SETTINGS
@given(specs)
def test_no_parameter_is_read_after_the_call_that_steps_it_and_training_is_unchanged(s: Spec):
    model, batches = make(s)
    ref = copy.deepcopy(model)
    engine, losses = train(model, [(b,) for b in batches], steps=2, lr=1e-2)
    ref_engine, ref_losses = train(ref, [(b,) for b in batches], steps=2, lr=1e-2, disable_passes=OFF)
    assert losses == ref_losses
    assert_same_training(model, ref, engine, ref_engine)
    prog = program(engine)
    check_no_reader_after_its_step(prog.gm, prog.signature)
    # every trainable Parameter stepped exactly once per step: in the graph or after it
    returned = [s.target for s in prog.signature.outputs if s.kind == "grad"]
    names = prog.signature.stepped_in_backward + returned
    canon = [prog.signature.tied.get(n, n) for n in names]
    assert len(set(canon)) == len({id(p) for p in model.parameters()})


def check_no_reader_after_its_step(gm: fx.GraphModule, sig) -> None:  # noqa: ANN001
    """The validator: after a step_parameters (step_buckets) call, no node reads a parameter (a
    bucket's parameter or shard) it stepped or a value that may share that input's storage."""
    nodes = list(gm.graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    for call in (n for n in nodes if n.target in (step_parameters_op, step_buckets_op)):
        for p in call.args[2]:
            aliases, stack = {p}, [p]
            while stack:
                for u in stack.pop().users:
                    if u is call:
                        continue
                    assert order[u] < order[call], f"{u.name} reads {p.name} after {call.name} stepped it"
                    schema = getattr(u.target, "_schema", None)
                    if u not in aliases and (u.target is operator.getitem or schema is None
                                             or any(r.alias_info is not None for r in schema.returns)):
                        aliases.add(u)
                        stack.append(u)


@pytest.mark.parametrize("config", [dict(grad_clip=1.0), dict(grad_accum=2), dict(precision="fp16"),
                                    dict(nan_check="skip")], ids=["clip", "accumulate", "fp16", "nan-check"])
def test_configs_that_need_every_gradient_first_keep_the_step_at_the_end(config):
    model, batch = gpt()
    engine, _ = train(model, [batch], steps=1, **config)
    assert program(engine).signature.stepped_in_backward == []
    assert engine._in_backward is None


def test_one_stage_steps_inside_backward_on_any_number_of_replicas_but_not_a_pipeline():
    c = fxspeed.Config()
    assert steps_in_backward(c, 1) and steps_in_backward(c, 2)  # by parameter; by reduced bucket
    assert not steps_in_backward(fxspeed.Config(pipeline=2, microbatches=2), 1)
    # the offloaded optimizer reads its files in bucket order: only where there are buckets
    offload = dict(offload="optimizer", offload_device="nvme", nvme_path="/tmp")
    assert steps_in_backward(fxspeed.Config(**offload), 2)
    assert steps_in_backward(fxspeed.Config(**offload, zero=1, precision="bf16"), 1)
    assert not steps_in_backward(fxspeed.Config(**offload), 1)
    assert not steps_in_backward(fxspeed.Config(zero=3, precision="bf16", offload="parameters",
                                                offload_device="nvme", nvme_path="/tmp"), 2)


def hand_graph(return_view: bool) -> tuple[fx.GraphModule, StepSignature]:
    """w's gradient is produced first, w is read after it; with `return_view` a view of w is a
    program output."""
    aten = torch.ops.aten
    g = fx.Graph()
    w, x = g.placeholder("w"), g.placeholder("x")
    w.meta["val"], x.meta["val"] = torch.empty(4, 4), torch.empty(2, 4)
    gw = g.call_function(aten.mul.Tensor, (w, 2.0))
    late = g.call_function(aten.mm.default, (x, g.call_function(aten.t.default, (w,))))
    outs = [late, gw]
    if return_view:
        outs.append(g.call_function(aten.t.default, (w,)))
    for n in g.nodes:
        if n.op == "call_function":
            n.meta["val"] = n.target(*[a.meta["val"] if isinstance(a, fx.Node) else a for a in n.args])
    g.output(tuple(outs))
    sig = StepSignature([IOSpec("param", "w"), IOSpec("input", "0")],
                        [IOSpec("loss", "loss"), IOSpec("grad", "w"), *([IOSpec("output", "1")] if return_view else [])])
    return fx.GraphModule(nn.Module(), g), sig


def test_the_step_goes_after_the_last_reader_of_the_weight_or_its_views_not_after_its_gradient():
    gm, sig = hand_graph(return_view=False)
    res = step_in_backward(gm, PassContext(signature=sig, options={"optimizer_store": "s"}))
    assert res.modified and sig.stepped_in_backward == ["w"] and [s.kind for s in sig.outputs] == ["loss"]
    nodes = list(gm.graph.nodes)
    call = next(n for n in nodes if n.target is step_parameters_op)
    mm = next(n for n in nodes if n.target is torch.ops.aten.mm.default)
    assert nodes.index(call) > nodes.index(mm)
    check_no_reader_after_its_step(gm, sig)


def test_a_weight_a_program_output_aliases_is_left_to_the_step_after_the_program():
    gm, sig = hand_graph(return_view=True)
    res = step_in_backward(gm, PassContext(signature=sig, options={"optimizer_store": "s"}))
    assert not res.modified and sig.stepped_in_backward == [] and len(sig.outputs) == 3


def test_an_lr_changed_behind_the_schedule_is_refused_before_any_parameter_moves():
    model, batch = gpt()
    engine, _ = train(model, [batch], steps=1)
    before = [p.detach().clone() for p in model.parameters()]
    engine.optimizer.param_groups[0]["lr"] = 0.5
    with pytest.raises(FxspeedError, match="lr_schedule='manual'"):
        engine.train_step(*batch)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


def test_a_program_failing_after_some_parameters_moved_stops_training_until_a_checkpoint_is_loaded(tmp_path):
    model, batch = gpt()
    engine, _ = train(model, [batch], steps=1, bucket_mb=0.01)  # small buckets: several calls per step
    engine.save(tmp_path / "ck")
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    steps = engine._in_backward
    real, calls = steps.step, []

    def fail_on_the_second_bucket(names, grads):  # noqa: ANN001
        calls.append(names)
        if len(calls) == 2:
            raise RuntimeError("out of memory (simulated)")
        real(names, grads)

    steps.step = fail_on_the_second_bucket
    with pytest.raises(FxspeedError, match="partly stepped") as err:
        engine.train_step(*batch)
    assert isinstance(err.value.__cause__, RuntimeError)
    steps.step = real
    with pytest.raises(FxspeedError, match="engine.load"):
        engine.train_step(*batch)  # refused: never trains on a half-stepped model
    engine.load(tmp_path / "ck")
    assert all(torch.equal(v, saved[k]) for k, v in model.state_dict().items())
    engine.train_step(*batch)


def test_a_ctrl_c_between_buckets_reaches_the_user_and_the_half_stepped_model_cannot_be_saved(tmp_path):
    """A KeyboardInterrupt stays one (the user's `except KeyboardInterrupt: save` runs), and that
    save is refused: it would hold some parameters of the new step and the rest of the old one,
    and load and train on silently."""
    model, batch = gpt()
    engine, _ = train(model, [batch], steps=1, bucket_mb=0.01)
    steps = engine._in_backward
    real, calls = steps.step, []

    def interrupted_on_the_second_bucket(names, grads):  # noqa: ANN001
        calls.append(names)
        if len(calls) == 2:
            raise KeyboardInterrupt
        real(names, grads)

    steps.step = interrupted_on_the_second_bucket
    with pytest.raises(KeyboardInterrupt):
        engine.train_step(*batch)
    steps.step = real
    for save in (lambda: engine.save(tmp_path / "ck"), lambda: engine.export(tmp_path / "m.safetensors")):
        with pytest.raises(FxspeedError, match="would mix two steps' weights"):
            save()
    assert not (tmp_path / "ck").exists() and not (tmp_path / "m.safetensors").exists()


def test_under_tensor_parallelism_the_steps_come_after_the_collectives_that_finish_the_gradients():
    """A program compiled without a plan (a later batch shape) too: shard_tensors runs before
    step_in_backward, so no call steps a partial (not yet all-reduced) gradient."""
    from fxspeed.compiler import compile_step
    from fxspeed.compiler.options import PassOptions
    from fxspeed.devices import devices
    from fxspeed.planner.placement import PlacementAnalysis

    model, (x, y) = gpt()
    analysis = PlacementAnalysis([devices("cpu")[0]])
    opts = PassOptions.single_device(fxspeed.Config(), tp_size=2, tp_rank=0, tp_group_name="tp",
                                     optimizer_store="s")
    for analyze in (None, lambda gm, sig: None):
        cs = compile_step(model, (x, y), {}, config=fxspeed.Config(), loss_fn=None, options=opts, train=True,
                          analyses=[analysis.graph_pass], analyze=analyze)
        names = [r.name for r in cs.records if not r.skipped]
        assert names.index("shard_tensors") < names.index("step_in_backward")
        gm = cs.captured.gm
        nodes = list(gm.graph.nodes)
        calls = [n for n in nodes if n.target is step_parameters_op]
        assert calls and cs.captured.signature.stepped_in_backward
        waits = [n for n in nodes if "wait_tensor" in str(n.target)]
        for call in calls:  # every collective whose result a stepped gradient depends on runs before the call
            for g in call.args[3]:
                assert all(nodes.index(w) < nodes.index(call) for w in waits if w in _ancestors(g))
        check_no_reader_after_its_step(gm, cs.captured.signature)


def _ancestors(n: fx.Node) -> set:
    seen, stack = set(), [n]
    while stack:
        for a in stack.pop().all_input_nodes:
            if a not in seen:
                seen.add(a)
                stack.append(a)
    return seen


@SETTINGS
@given(specs, st.sampled_from([0, 1, 2, 3]), st.sampled_from([2, 4]))
def test_each_reduced_bucket_is_stepped_once_after_the_last_reader_of_its_weights(s: Spec, zero: int, world: int):
    """Data-parallel programs (rank 0 of `world`, compiled without processes: the validator reads
    the graph): every bucket is stepped inside backward once or returned, never both; no node
    reads a bucket's parameters (or ZeRO-3 shard) after the call that steps them; and a call
    waits for nothing the next bucket's collective needs (it comes after that issue)."""
    from fxspeed.compiler import compile_step
    from fxspeed.compiler.options import PassOptions

    model, batches = make(s)
    opts = PassOptions.single_device(fxspeed.Config(), world_size=world, rank=0, zero=zero, group_name="dp",
                                     bucket_bytes=2048, optimizer_store="s")
    cs = compile_step(model, (batches[0],), {}, config=fxspeed.Config(zero=zero), loss_fn=None, options=opts,
                      train=True)
    gm, sig = cs.captured.gm, cs.captured.signature
    check_no_reader_after_its_step(gm, sig)
    calls = [n for n in gm.graph.nodes if n.target is step_buckets_op]
    stepped = [k for c in calls for k in c.args[1]]
    returned = [int(o.target) for o in sig.outputs if o.kind == "grad_bucket"]
    assert sorted(stepped + returned) == list(range(len(sig.buckets)))
    assert sig.stepped_in_backward == [n for k in stepped for n in sig.buckets[k].names]
    assert stepped or not sig.buckets or returned
    nodes = list(gm.graph.nodes)
    for c in calls:  # a step never holds back a collective that is ready to be issued
        for n in nodes[nodes.index(c) + 1:]:
            if "wait_tensor" in str(n.target) or n.op == "output":
                break
            assert not is_collective(n), f"{c.name} delays {n.name}"


def test_every_bucket_of_a_gpt_is_stepped_right_after_the_next_buckets_collective_is_issued():
    from fxspeed.compiler import compile_step
    from fxspeed.compiler.options import PassOptions

    model, batch = gpt()
    # reduce_dtype: the bucket is reduced in bf16 and cast back to fp32, a cast reduce_gradients
    # puts before the output; the pass moves it up so the step need not wait for the end
    for zero, reduce_dtype in [(0, "auto"), (1, "auto"), (2, "auto"), (3, "auto"), (2, "bf16")]:
        config = fxspeed.Config(zero=zero, reduce_dtype=reduce_dtype)
        opts = PassOptions.single_device(config, world_size=2, rank=0, zero=zero, group_name="dp",
                                         bucket_bytes=40000, optimizer_store="s")
        cs = compile_step(model, batch, {}, config=config, loss_fn=None, options=opts, train=True)
        nodes = list(cs.captured.gm.graph.nodes)
        calls = [n for n in nodes if n.target is step_buckets_op]
        assert len(calls) == len(cs.captured.signature.buckets) >= 3, zero
        assert not [o for o in cs.captured.signature.outputs if o.kind == "grad_bucket"]
        # all but the last run while the next bucket's reduction is in flight
        assert all(is_collective(nodes[nodes.index(c) - 1]) for c in calls[:-1]), zero


@pytest.mark.slow
def test_on_two_ranks_stepping_each_reduced_bucket_inside_backward_trains_bit_for_bit_like_the_step_at_the_end(
        tmp_path):
    """ZeRO-0/1/2/3, bf16 master weights, and the offloaded optimizer (masters and moments in the
    file): tests/workers/step_in_backward_worker.py."""
    from tests.multiprocess import check_swap_worker

    check_swap_worker("tests.workers.step_in_backward_worker", tmp_path)
