"""The pass manager's contract: requires/produces, verification after every pass, records,
disabling passes by name, and errors that say which pass failed after which others."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
from torch.fx.experimental.proxy_tensor import make_fx

from fxspeed.compiler.annotate import make_annotate_pass
from fxspeed import Config, ConfigError, PassError
from fxspeed.compiler import compile_step
from fxspeed.ir import IOSpec, StepSignature
from fxspeed.compiler.pass_manager import PassContext, PassManager, PassRecord, PassResult, graph_pass, verify
from fxspeed.passes import ALL_PASSES, SINGLE_DEVICE_PASSES, default_pipeline

aten = torch.ops.aten


# ------------------------------------------------------------------------------------------
# Helpers: a small ATen graph with meta['val'] on every node, and a signature describing it
# ------------------------------------------------------------------------------------------

def _step(w: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    y = torch.relu(x @ w)
    unused = w.t() * 3  # noqa: F841 - dead on purpose
    return y.sum(), y.detach() * 2


def small_graph() -> tuple[fx.GraphModule, PassContext]:
    gm = make_fx(_step)(torch.randn(3, 3), torch.randn(2, 3))
    sig = StepSignature(inputs=[IOSpec("param", "w"), IOSpec("input", "0")],
                        outputs=[IOSpec("loss", "loss"), IOSpec("output", "0")])
    return gm, PassContext(signature=sig)


def noop_pass(name: str, **decl):
    @graph_pass(name, **decl)
    def fn(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        return PassResult(gm, modified=False)

    return fn


def marking_analysis(name: str, log: list[str]):
    @graph_pass(name, is_analysis=True)
    def fn(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        log.append(name)
        for n in gm.graph.nodes:
            n.meta[name] = True
        return PassResult(gm, modified=False)

    return fn


# ------------------------------------------------------------------------------------------
# requires / produces / invalidates
# ------------------------------------------------------------------------------------------

def test_a_pass_requiring_an_analysis_nobody_produces_fails_naming_the_pass_and_the_passes_run_before():
    gm, ctx = small_graph()
    pm = PassManager([noop_pass("first"), noop_pass("second"), noop_pass("needy", requires=("liveness",))])
    with pytest.raises(PassError) as e:
        pm.run(gm, ctx)
    msg = str(e.value)
    assert "'needy'" in msg and "'liveness'" in msg
    assert "first" in msg and "second" in msg


def test_a_required_analysis_that_is_registered_is_run_on_demand_before_the_pass():
    gm, ctx = small_graph()
    log: list[str] = []
    seen: list[bool] = []

    @graph_pass("reader", requires=("shapes",))
    def reader(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        seen.append(all(n.meta.get("shapes") for n in gm.graph.nodes))
        return PassResult(gm, modified=False)

    pm = PassManager([reader], analyses=[marking_analysis("shapes", log)])
    pm.run(gm, ctx)
    assert log == ["shapes"] and seen == [True]
    assert [r.name for r in pm.records] == ["shapes", "reader"]
    assert "shapes" in ctx.valid


def test_a_valid_analysis_is_not_run_again_but_an_invalidated_one_is():
    gm, ctx = small_graph()
    log: list[str] = []

    @graph_pass("rewriter", invalidates=("shapes",))
    def rewriter(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        return PassResult(gm, modified=True)

    passes = [noop_pass("a", requires=("shapes",)), noop_pass("b", requires=("shapes",)), rewriter,
              noop_pass("c", requires=("shapes",))]
    PassManager(passes, analyses=[marking_analysis("shapes", log)]).run(gm, ctx)
    assert log == ["shapes", "shapes"]  # once for a (reused by b), once more after the rewrite


def test_an_analysis_produced_by_an_earlier_pass_satisfies_a_later_requirement():
    gm, ctx = small_graph()
    pm = PassManager([noop_pass("producer", produces=("facts",)), noop_pass("consumer", requires=("facts",))])
    pm.run(gm, ctx)
    assert [r.name for r in pm.records] == ["producer", "consumer"]


def test_a_requirement_whose_producer_is_disabled_fails_and_says_the_producer_is_disabled():
    gm, ctx = small_graph()
    pm = PassManager([noop_pass("producer", produces=("facts",)), noop_pass("consumer", requires=("facts",))],
                     disabled=["producer"])
    with pytest.raises(PassError, match=r"'consumer'.*'facts'.*disabled.*producer"):
        pm.run(gm, ctx)


def test_ensuring_an_unregistered_analysis_fails_with_the_registered_names():
    gm, ctx = small_graph()
    pm = PassManager([], analyses=[marking_analysis("shapes", [])])
    with pytest.raises(PassError, match=r"'nope'.*shapes"):
        pm.ensure("nope", gm, ctx)


# ------------------------------------------------------------------------------------------
# verification after every pass
# ------------------------------------------------------------------------------------------

def test_a_pass_that_leaves_a_dangling_node_is_rejected_naming_it_and_the_passes_before():
    gm, ctx = small_graph()

    @graph_pass("dangler")
    def dangler(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        relu = next(n for n in gm.graph.nodes if n.target is aten.relu.default)
        other = fx.Graph()
        foreign = other.placeholder("elsewhere")  # a node of another graph
        relu.args = (foreign,)
        return PassResult(gm, modified=False)

    pm = PassManager([noop_pass("harmless"), dangler])
    with pytest.raises(PassError, match=r"'dangler' \(after \['harmless'\]\) left an invalid graph"):
        pm.run(gm, ctx)


def test_a_pass_that_erases_a_node_still_in_use_is_rejected_naming_it():
    gm, ctx = small_graph()

    @graph_pass("eraser")
    def eraser(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        mm = next(n for n in gm.graph.nodes if n.target is aten.mm.default)
        gm.graph.erase_node(mm)  # fx refuses: relu still reads it
        return PassResult(gm, modified=True)

    with pytest.raises(PassError, match=r"'eraser' failed after no other passes"):
        PassManager([eraser]).run(gm, ctx)


def test_a_pass_that_changes_the_number_of_outputs_is_rejected_naming_it():
    gm, ctx = small_graph()

    @graph_pass("dropper")
    def dropper(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        out = next(n for n in gm.graph.nodes if n.op == "output")
        out.args = (out.args[0][:1],)
        return PassResult(gm, modified=True)

    with pytest.raises(PassError, match=r"'dropper'.*1 graph outputs but the signature describes 2"):
        PassManager([noop_pass("harmless"), dropper]).run(gm, ctx)


def test_a_pass_that_changes_the_number_of_inputs_is_rejected_naming_it():
    gm, ctx = small_graph()

    @graph_pass("adder")
    def adder(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        first = next(iter(gm.graph.nodes))
        with gm.graph.inserting_before(first):
            gm.graph.placeholder("extra")
        return PassResult(gm, modified=True)

    with pytest.raises(PassError, match=r"'adder'.*3 graph inputs but the signature describes 2"):
        PassManager([adder]).run(gm, ctx)


def test_a_pass_that_adds_a_node_without_a_fake_value_is_rejected_naming_the_node():
    gm, ctx = small_graph()

    @graph_pass("untyped")
    def untyped(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        relu = next(n for n in gm.graph.nodes if n.target is aten.relu.default)
        with gm.graph.inserting_after(relu):
            neg = gm.graph.call_function(aten.neg.default, (relu,))
        relu.replace_all_uses_with(neg, delete_user_cb=lambda u: u is not neg)
        return PassResult(gm, modified=True)

    with pytest.raises(PassError, match=r"'untyped'.*'neg_default'.*meta\['val'\]"):
        PassManager([untyped]).run(gm, ctx)


def test_a_pass_that_raises_is_reported_with_its_name_the_passes_run_before_and_the_cause():
    gm, ctx = small_graph()

    @graph_pass("boom")
    def boom(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        raise RuntimeError("kaput")

    with pytest.raises(PassError) as e:
        PassManager([noop_pass("one"), noop_pass("two"), boom]).run(gm, ctx)
    assert "'boom' failed after ['one', 'two']" in str(e.value)
    assert "RuntimeError: kaput" in str(e.value)
    assert isinstance(e.value.__cause__, RuntimeError)


def test_every_single_device_pass_leaves_the_small_graph_valid():
    for p in SINGLE_DEVICE_PASSES:
        gm, ctx = small_graph()
        gm = PassManager([p], analyses=[make_annotate_pass()]).run(gm, ctx)
        verify(gm, ctx.signature)


# ------------------------------------------------------------------------------------------
# records
# ------------------------------------------------------------------------------------------

def test_each_pass_records_its_time_node_counts_and_whether_it_changed_the_graph():
    gm, ctx = small_graph()
    n0 = len(gm.graph.nodes)
    pm = PassManager([ALL_PASSES["normalize_graph"], noop_pass("idle"), ALL_PASSES["eliminate_dead_code"]])
    gm = pm.run(gm, ctx)
    norm, idle, dce = pm.records
    assert all(isinstance(r, PassRecord) and r.seconds >= 0 and not r.skipped for r in pm.records)
    assert (norm.nodes_before, norm.nodes_after, norm.modified) == (n0, n0 - 1, True)  # one detach
    assert (idle.nodes_before, idle.nodes_after, idle.modified) == (n0 - 1, n0 - 1, False)
    assert dce.nodes_before == n0 - 1 and dce.nodes_after < dce.nodes_before and dce.modified
    assert dce.nodes_after == len(gm.graph.nodes)
    assert set(norm.to_dict()) == {"name", "seconds", "nodes_before", "nodes_after", "modified", "skipped"}


# ------------------------------------------------------------------------------------------
# disabling passes through Config
# ------------------------------------------------------------------------------------------

class TiedMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.b.weight = self.a.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x))).pow(2).mean()


def test_the_default_pipeline_runs_every_pass_in_order_and_records_each():
    compiled = compile_step(TiedMLP(), (torch.randn(2, 4),), {}, config=Config(), loss_fn=None)
    names = [r.name for r in compiled.records]
    assert [p.name for p in default_pipeline()] == [
        "normalize_graph", "dedupe_tied_parameters", "insert_casts", "scale_loss", "eliminate_dead_code",
        "reduce_gradients", "wait_parameter_gathers", "shard_parameters", "reuse_buffers"]
    # annotate runs on demand before insert_casts (which reads module paths); in fp32 nothing
    # after it changes the graph, so it stays valid to the end (the planner reads it there).
    assert names == ["normalize_graph", "dedupe_tied_parameters", "annotate", "insert_casts", "scale_loss",
                     "eliminate_dead_code", "reduce_gradients", "wait_parameter_gathers", "shard_parameters",
                     "reuse_buffers"]


def test_a_pass_disabled_in_config_is_skipped_and_recorded_as_skipped():
    compiled = compile_step(TiedMLP(), (torch.randn(2, 4),), {},
                            config=Config(disable_passes=("dedupe_tied_parameters",)), loss_fn=None)
    rec = {r.name: r for r in compiled.records}
    skipped = rec["dedupe_tied_parameters"]
    assert skipped.skipped and not skipped.modified and skipped.seconds == 0.0
    assert skipped.nodes_before == skipped.nodes_after
    assert not rec["normalize_graph"].skipped
    # the tied weight is still fed under both names, as captured
    assert [s.target for s in compiled.captured.signature.inputs if s.kind == "param"].count("a.weight") == 1
    assert any(s.target == "b.weight" for s in compiled.captured.signature.inputs)


def test_disabling_an_unknown_pass_fails_with_a_config_error_listing_the_known_passes():
    with pytest.raises(ConfigError) as e:
        compile_step(TiedMLP(), (torch.randn(2, 4),), {}, config=Config(disable_passes=("no_such_pass",)),
                     loss_fn=None)
    msg = str(e.value)
    assert "no_such_pass" in msg and "disable_passes" in msg
    for name in ALL_PASSES:
        assert name in msg
