"""Unit tests of the planner: liveness, FLOPs, categories, the ZeRO formula, symbolic fits."""

from __future__ import annotations

import copy

import json

import pytest
import sympy
import torch
import torch.fx as fx
import torch.nn as nn
from torch.fx import graph_module
from torch.fx.experimental.proxy_tensor import make_fx

import fxspeed
from fxspeed.compiler.annotate import node_flops
from fxspeed.ir import (ACTIVATIONS, GRADIENTS, META_KEY, OPTIMIZER_STATES, PARAMETERS, TEMPORARIES, NodeInfo)
from fxspeed.planner.memory import memory_timeline, program_liveness
from fxspeed.models.gpt import GPT, GPTConfig
from fxspeed.planner import opt_factors, optimizer_temporaries, repeated_blocks, zero_paper_bytes
from fxspeed.planner.symbolic import fit_polynomial, is_batch_like, sample_values

OFF = ("step_in_backward", "step_buckets_in_backward")  # the step after the program, as the ZeRO paper counts it

aten = torch.ops.aten
F32 = 4


# --------------------------------------------------------------------------------------------
# Liveness on hand-built graphs
# --------------------------------------------------------------------------------------------

class _G:
    """Builds a graph node by node: each node gets a meta tensor of `numel` floats as its value.
    `memory_timeline(...).totals` has one entry per node, the output node last."""

    def __init__(self) -> None:
        self.g = fx.Graph()

    def input(self, name: str, numel: int, category: str = "inputs") -> fx.Node:
        n = self.g.placeholder(name)
        n.meta["val"] = torch.empty(numel, device="meta")
        n.meta[META_KEY] = NodeInfo(category=category, role="io")
        return n

    def op(self, target, *args, numel: int, category: str = TEMPORARIES, view: bool = False) -> fx.Node:
        n = self.g.call_function(target, args)
        n.meta["val"] = torch.empty(numel, device="meta")
        n.meta[META_KEY] = NodeInfo(category=category, is_view=view)
        return n

    def done(self, *outs: fx.Node) -> fx.GraphModule:
        self.g.output(tuple(outs))
        return fx.GraphModule(nn.Module(), self.g)


def test_liveness_peak_of_a_chain_is_the_input_plus_two_neighbouring_values():
    b = _G()
    x = b.input("x", 1000)
    a = b.op(aten.relu.default, x, numel=1000)
    c = b.op(aten.mul.Tensor, a, 2, numel=1000)  # a dies here, after c is allocated
    d = b.op(aten.sum.default, c, numel=1)
    tl = memory_timeline(b.done(d))
    assert tl.totals == [4000, 8000, 12000, 8004, 4004]
    assert tl.peak_bytes == 12000 and tl.names[tl.peak_index] == c.name


def test_liveness_frees_each_value_after_its_last_reader_not_before():
    b = _G()
    x = b.input("x", 100)
    a = b.op(aten.relu.default, x, numel=1000)
    c = b.op(aten.neg.default, x, numel=500)
    d = b.op(aten.add.Tensor, a, c, numel=1000)  # a and c both read here: both alive until d
    tl = memory_timeline(b.done(d))
    assert tl.totals == [400, 4400, 6400, 10400, 4400]
    assert tl.peak_bytes == 10400


def test_a_view_allocates_nothing_and_keeps_its_base_alive_until_the_view_is_last_read():
    b = _G()
    x = b.input("x", 10)
    a = b.op(aten.relu.default, x, numel=1000)
    v = b.op(aten.view.default, a, [1000], numel=1000, view=True)
    big = b.op(aten.neg.default, x, numel=2000)  # a is not read here, but its view is later
    y = b.op(aten.add.Tensor, v, big, numel=1)
    tl = memory_timeline(b.done(y))
    assert tl.totals == [40, 4040, 4040, 12040, 12044, 44]


def test_graph_outputs_stay_alive_to_the_end_of_the_step():
    b = _G()
    x = b.input("x", 10)
    g = b.op(aten.relu.default, x, numel=1000, category=GRADIENTS)
    t = b.op(aten.neg.default, x, numel=3000)
    s = b.op(aten.sum.default, t, numel=1)
    tl = memory_timeline(b.done(s, g))
    assert tl.totals == [40, 4040, 16040, 16044, 4044]
    assert tl.peak == {"inputs": 40, GRADIENTS: 4000, TEMPORARIES: 12004}


def test_a_tensor_saved_for_backward_through_a_view_counts_as_an_activation():
    b = _G()
    x = b.input("x", 10)
    a = b.op(aten.relu.default, x, numel=1000)  # forward; only its view is saved
    v = b.op(aten.view.default, a, [1000], numel=1000, category=ACTIVATIONS, view=True)
    y = b.op(aten.neg.default, v, numel=1)
    tl = memory_timeline(b.done(y))
    assert tl.peak[ACTIVATIONS] == 4000 and tl.peak.get(TEMPORARIES, 0) <= 4


def test_a_program_input_freed_at_its_last_use_lowers_the_programs_peak_above_its_inputs():
    # What a pipeline stage program holds beyond the tensors it is handed (program_liveness).
    b = _G()
    saved = b.input("saved", 1000)
    a = b.op(aten.relu.default, saved, numel=1000)  # saved's last reader
    c = b.op(aten.neg.default, a, numel=2000)
    pl = program_liveness(b.done(c))
    assert pl.inputs == [4000] and pl.last_use == [1] and pl.live == [0, 4000, 12000, 8000]
    assert pl.peak() == 12000  # the input stays (someone else holds it)
    assert pl.peak({0}) == 8000  # handed over and freed after relu: c is allocated once saved is gone
    assert pl.outputs == [(8000, None, 2)]


def test_out_and_in_place_results_are_their_operands_storage_not_new_allocations():
    g = fx.Graph()
    x, w, buf = (g.placeholder(n) for n in ("x", "w", "buf"))
    for n, shape in ((x, (8, 16)), (w, (16, 4)), (buf, (8, 4))):
        n.meta["val"] = torch.empty(shape, device="meta")
    acc = g.call_function(aten.addmm.out, (buf, x, w), {"beta": 1.0, "out": buf})  # writes into buf
    acc.meta["val"] = torch.empty(8, 4, device="meta")
    view = g.call_function(aten.t.default, (acc,))
    view.meta["val"] = torch.empty(4, 8, device="meta")
    g.output((view,))
    pl = program_liveness(fx.GraphModule(nn.Module(), g))
    assert max(pl.live) == 0  # nothing allocated
    assert pl.outputs == [(8 * 4 * F32, 2, 2)]  # the output is the buffer input, which stays to the end
    assert pl.last_use[2] == len(pl.live)


def test_a_gradient_computed_by_a_matmul_and_returned_through_a_transpose_counts_as_a_gradient():
    model = nn.Linear(256, 128, bias=False)
    # (the gradient returned, not stepped inside backward: see the next test)
    plan = fxspeed.plan(model, 1, fxspeed.Config(disable_passes=("step_in_backward",)),
                        example_inputs=(torch.randn(4, 256),), loss_fn=lambda out, x: out.sum())
    assert plan.phase_memory["optimizer"][GRADIENTS] == 256 * 128 * F32
    # At the end of backward every gradient is alive: the liveness sees the full gradient bytes.
    tl = plan.timeline
    assert tl["bytes"][-2] >= 256 * 128 * F32 * 2  # the weight and its gradient


def test_a_gradient_stepped_inside_backward_is_not_held_by_the_optimizer_phase_or_the_end_of_backward():
    model = nn.Linear(256, 128, bias=False)
    plan = fxspeed.plan(model, 1, example_inputs=(torch.randn(4, 256),), loss_fn=lambda out, x: out.sum())
    assert [r["name"] for r in plan.passes if r["name"] == "step_in_backward" and r["modified"]]
    assert plan.phase_memory["optimizer"][GRADIENTS] == 0
    assert plan.phase_memory["optimizer"][OPTIMIZER_STATES] == 2 * 256 * 128 * F32  # still trainable: Adam's states
    assert plan.timeline["bytes"][-1] < 256 * 128 * F32 * 2  # the gradient died at its step
    assert any("inside backward" in n for n in plan.notes)


# --------------------------------------------------------------------------------------------
# FLOPs and categories
# --------------------------------------------------------------------------------------------

def test_flops_of_a_matmul_are_two_times_m_times_n_times_k():
    m, k, n = 3, 5, 7
    gm = make_fx(torch.mm, tracing_mode="fake")(torch.empty(m, k), torch.empty(k, n))
    mm = next(x for x in gm.graph.nodes if x.op == "call_function")
    assert node_flops(mm) == 2 * m * n * k


def test_forward_flops_of_a_linear_layer_without_bias_are_two_times_batch_times_in_times_out():
    model = nn.Linear(64, 32, bias=False)
    plan = fxspeed.plan(model, 1, example_inputs=(torch.randn(8, 64),), loss_fn=lambda out, x: out.sum())
    assert plan.flops["forward"] == 2 * 8 * 64 * 32
    assert plan.flops["backward"] == 2 * 8 * 64 * 32  # weight gradient only: the input needs none


def test_every_node_of_a_planned_step_has_a_category_and_parameters_are_counted_once_when_tied():
    model = GPT(GPTConfig.preset("tiny"))
    ids = torch.zeros(2, 16, dtype=torch.long)
    plan = fxspeed.plan(model, 1, example_inputs=(ids, ids))
    n_params = sum(p.numel() for p in model.parameters())  # the tied head counted once
    assert plan.n_params == n_params
    mem = plan.memory()
    assert mem[PARAMETERS] == n_params * F32
    assert mem[OPTIMIZER_STATES] == 2 * n_params * F32
    assert set(plan.phase_memory) == {"step", "optimizer"}
    assert plan.peak_memory() == max(sum(d.values()) for d in plan.phase_memory.values())


def test_a_meta_model_and_the_same_model_on_the_cpu_get_the_same_plan():
    torch.manual_seed(0)
    real = GPT(GPTConfig.preset("tiny"))
    with torch.device("meta"):
        meta = GPT(GPTConfig.preset("tiny"))
    ids = torch.zeros(2, 16, dtype=torch.long)
    a = fxspeed.plan(real, 1, example_inputs=(ids, ids))
    b = fxspeed.plan(meta, 1, example_inputs=(ids.to("meta"), ids.to("meta")))
    assert a.rank_memory == b.rank_memory and a.flops == b.flops
    assert all(p.is_meta for p in meta.parameters())  # the meta model is left as it was


# --------------------------------------------------------------------------------------------
# Optimizer and ZeRO formulas
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("stage,gb", [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.88)])
def test_zero_paper_formula_gives_the_papers_numbers_for_7_5b_params_on_64_gpus(stage, gb):
    # ZeRO paper, Figure 1: Psi = 7.5B, N_d = 64, K = 12 (mixed-precision Adam), 2-byte params/grads.
    assert zero_paper_bytes(7.5e9, stage, 64, k=12, bytes_per_param=2) / 1e9 == pytest.approx(gb, abs=0.05)


@pytest.mark.parametrize("stage,expected", [(0, 16 * 7.5e9), (1, 8 * 7.5e9 + 8 * 7.5e9 / 64),
                                            (2, 4 * 7.5e9 + 12 * 7.5e9 / 64), (3, 16 * 7.5e9 / 64)])
def test_zero_paper_formula_for_fp32_adam_uses_k_8_and_4_byte_params_and_grads(stage, expected):
    assert zero_paper_bytes(7.5e9, stage, 64, k=8, bytes_per_param=4) == pytest.approx(expected)


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_planned_model_states_per_rank_equal_the_fp32_zero_formula_at_every_stage(zero):
    model = nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 64))
    n = sum(p.numel() for p in model.parameters())
    # the formula's layout: every gradient held until a step after backward
    plan = fxspeed.plan(model, fxspeed.devices("H100-80GB", 8), fxspeed.Config(zero=zero, disable_passes=OFF),
                        example_inputs=(torch.randn(4, 128),), loss_fn=lambda out, x: out.sum())
    opt = plan.phase_memory["optimizer"]
    states = opt[PARAMETERS] + opt[GRADIENTS] + opt[OPTIMIZER_STATES]
    assert states == pytest.approx(zero_paper_bytes(n, zero, 8, k=8, bytes_per_param=4), abs=3)
    assert plan.zero_formula[0] == pytest.approx(states, abs=3)
    # stepped inside backward: ZeRO-1/2/3 hold no gradient at the step; ZeRO-0's reduced buckets persist
    inside = fxspeed.plan(model, fxspeed.devices("H100-80GB", 8), fxspeed.Config(zero=zero),
                          example_inputs=(torch.randn(4, 128),), loss_fn=lambda out, x: out.sum())
    assert inside.phase_memory["optimizer"][GRADIENTS] == (opt[GRADIENTS] if zero == 0 else 0)


def test_adam_states_are_two_per_parameter_and_sgd_with_momentum_keeps_one():
    assert opt_factors(fxspeed.Config(optimizer="adamw"))[0] == 2
    assert opt_factors(fxspeed.Config(optimizer="sgd", momentum=0.9))[0] == 1
    assert opt_factors(fxspeed.Config(optimizer="sgd"))[0] == 0


def test_optimizer_temporaries_are_none_with_fused_kernels_on_cpu_and_cuda():
    gpu, cpu = fxspeed.devices("H100-80GB")[0], fxspeed.devices("cpu")[0]
    for cfg in (fxspeed.Config(optimizer="adamw"), fxspeed.Config(optimizer="adam", weight_decay=0.1),
                fxspeed.Config(optimizer="sgd")):
        assert optimizer_temporaries(cfg, gpu, 1000.0, 100.0) == 0.0
        assert optimizer_temporaries(cfg, cpu, 1000.0, 100.0) == 0.0


def test_the_runtime_builds_fused_optimizers_on_cpu():
    from fxspeed.runtime.optimizer import OptimizerSpec, build_optimizer

    p = torch.nn.Parameter(torch.randn(4))
    for name in ("adamw", "adam", "sgd"):
        opt, _ = build_optimizer([p], OptimizerSpec(name=name))
        assert opt.defaults["fused"] is True, name


# --------------------------------------------------------------------------------------------
# Repeated blocks, serialization
# --------------------------------------------------------------------------------------------

def test_repeated_blocks_finds_the_module_list_of_identical_blocks():
    model = GPT(GPTConfig.preset("tiny"))
    parent, attr, blocks = repeated_blocks(model)
    assert parent is model and attr == "blocks" and len(blocks) == 2


def test_layer_extrapolation_from_two_three_and_four_blocks_matches_tracing_all_blocks():
    cfg = GPTConfig(vocab_size=128, block_size=32, n_layer=6, n_head=2, n_embd=32)
    with torch.device("meta"):
        model = GPT(cfg)
    ids = torch.zeros(2, 32, dtype=torch.long, device="meta")
    before = set(graph_module._loader.eval_cache)
    full = fxspeed.plan(model, 1, fxspeed.Config(layer_extrapolation=False), example_inputs=(ids, ids))
    extra = fxspeed.plan(model, 1, fxspeed.Config(layer_extrapolation=True), example_inputs=(ids, ids))
    # the trial compiles' programs are dropped with their generated sources (1 + 3 stayed in torch.fx's cache)
    assert set(graph_module._loader.eval_cache) - before == set()
    assert extra.n_params == full.n_params
    assert extra.flops == full.flops
    assert extra.phase_memory == full.phase_memory
    assert extra.time["total"] == pytest.approx(full.time["total"], rel=1e-9)
    assert any("repeated-layer extrapolation" in n for n in extra.notes)
    assert len(model.blocks) == 6  # the model is left whole


def test_a_plan_round_trips_through_json_unchanged():
    model = GPT(GPTConfig.preset("tiny"))
    ids = torch.zeros(2, 16, dtype=torch.long)
    plan = fxspeed.plan(model, 1, example_inputs=(ids, ids))
    again = fxspeed.Plan.from_json(plan.to_json())
    assert again == plan
    assert json.loads(plan.to_json()) == plan.to_dict()


# --------------------------------------------------------------------------------------------
# Symbolic fits
# --------------------------------------------------------------------------------------------

def test_fit_polynomial_recovers_a_polynomial_of_batch_times_seq_squared_exactly():
    b, s = sympy.symbols("batch seq")
    truth = 7 * b * s**2 + 3 * b * s + 11 * s**2 + 5 * b + 2
    points = [(bb, ss) for bb in (1, 2) for ss in (3, 5, 9)]
    fitted = fit_polynomial([b, s], [1, 2], points, [int(truth.subs({b: p[0], s: p[1]})) for p in points])
    assert sympy.expand(fitted - truth) == 0


def test_batch_dims_are_fitted_linearly_and_other_dims_quadratically():
    assert is_batch_like("batch") and is_batch_like("B") and not is_batch_like("seq")
    assert sample_values(256, 4) == [256, 128, 64, 192]
    assert sample_values(1, 3) == [1, 2, 3]
    assert sample_values(2, 3) == [2, 3, 4]  # no 1 unless the example is 1: its graph differs


def test_symbolic_plan_is_exact_at_an_untraced_size_and_max_size_answers_the_largest_batch_that_fits():
    with torch.device("meta"):
        model = GPT(GPTConfig.preset("tiny"))
    ids = torch.zeros(4, 64, dtype=torch.long, device="meta")
    dyn = {0: {0: "batch", 1: "seq"}, 1: {0: "batch", 1: "seq"}}
    plan = fxspeed.plan(model, 1, example_inputs=(ids, ids), dynamic=dyn)
    assert plan.dynamic["batch"][0] == 4 and plan.dynamic["seq"][0] == 64
    assert "symbolic fit" in " ".join(plan.notes)

    def concrete(batch: int, seq: int = 64) -> fxspeed.Plan:
        x = torch.zeros(batch, seq, dtype=torch.long, device="meta")
        return fxspeed.plan(model, 1, example_inputs=(x, x))

    big = concrete(48, 40)
    at = {"batch": 48, "seq": 40}
    assert int(plan.expr("peak_memory").subs(at)) == big.peak_memory()
    assert int(plan.expr("flops").subs(at)) == big.flops["total"]

    budget = 60e6
    n = plan.max_size("batch", budget)
    assert concrete(n).peak_memory() <= budget < concrete(n + 1).peak_memory()


def test_an_unmarked_input_shaped_like_a_marked_one_is_resized_with_it():
    with torch.device("meta"):
        model = GPT(GPTConfig.preset("tiny"))
    ids = torch.zeros(2, 32, dtype=torch.long, device="meta")
    plan = fxspeed.plan(model, 1, example_inputs=(ids, ids), dynamic={0: {0: "batch"}})
    assert plan.dynamic["batch"][0] == 2
    assert any("unmarked input(s) 1" in n for n in plan.notes)
    x = torch.zeros(5, 32, dtype=torch.long, device="meta")
    assert int(plan.expr("flops").subs({"batch": 5})) == fxspeed.plan(model, 1, example_inputs=(x, x)).flops["total"]


def test_a_symbol_marking_dims_of_different_sizes_is_refused_with_its_name():
    model = GPT(GPTConfig.preset("tiny"))
    a, b = torch.zeros(2, 16, dtype=torch.long), torch.zeros(3, 16, dtype=torch.long)
    with pytest.raises(fxspeed.ConfigError, match="'batch'"):
        fxspeed.plan(model, 1, example_inputs=(a, b), dynamic={0: {0: "batch"}, 1: {0: "batch"}})


def test_a_tensor_parallel_plan_is_one_tp_ranks_program_its_slices_and_its_share_of_the_step() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("small"))
    ids = torch.randint(0, 256, (2, 64))
    plans = {t: fxspeed.plan(model, t, fxspeed.Config(tensor=t), example_inputs=(ids, ids)) for t in (1, 2, 4)}
    n = sum(p.numel() for p in model.parameters())
    for t, plan in plans.items():
        assert plan.n_params == n and plan.strategy["tp"] == t
        # Norms, biases of row-parallel layers and the position table stay whole: a bit over 1/t.
        share = plan.memory()[PARAMETERS] / plans[1].memory()[PARAMETERS]
        assert 1 / t <= share <= 1 / t + 0.03, (t, share)
        assert plan.memory()[OPTIMIZER_STATES] == 2 * plan.memory()[PARAMETERS]
    assert any("tp rank 0's program" in note for note in plans[2].notes)


def test_the_offload_files_add_the_disk_time_that_does_not_fit_behind_compute_and_the_optimizer(tmp_path):
    from fxspeed.devices import DeviceSpec
    from fxspeed.planner.estimate import disk_time

    disk = DeviceSpec("d", 1e9, {"fp32": 1e11}, 1e10, 1e9, "cpu", disk_bandwidth=1e9)
    # states: read + written behind the optimizer's 1 s; shards: read twice behind 3 s of compute, written once
    assert disk_time(disk, 2e9, 0, compute=3.0, t_opt=1.0) == pytest.approx(3.0)
    assert disk_time(disk, 0, 1e9, compute=3.0, t_opt=1.0) == pytest.approx(0.0)
    assert disk_time(disk, 0, 2e9, compute=3.0, t_opt=1.0) == pytest.approx(1.0 + 1.0)
    unknown = DeviceSpec("d", 1e9, {"fp32": 1e11}, 1e10, 1e9, "cpu")
    assert disk_time(unknown, 2e9, 2e9, compute=0.0, t_opt=0.0) == 0.0

    model = GPT(GPTConfig.preset("small"))
    ids = torch.zeros(2, 64, dtype=torch.long)
    plain = fxspeed.plan(model, 1, fxspeed.Config(), example_inputs=(ids, ids))
    off = fxspeed.plan(model, 1, fxspeed.Config(offload="optimizer", nvme_path=str(tmp_path)), example_inputs=(ids, ids))
    assert "disk" not in plain.time and off.time["disk"] > 0
    assert off.time["total"] == pytest.approx(plain.time["total"] + off.time["disk"])
    assert "+ disk" in off.summary()


def test_a_small_models_plan_summary_shows_its_bytes_and_flops_in_a_unit_that_is_not_zero() -> None:
    from fxspeed.units import size

    assert (size(3.2e9), size(271_000), size(12), size(5e6, 10)) == ("3.20 GB", "271.00 kB", "12 bytes", "   5.00 MB")
    model = GPT(GPTConfig.preset("tiny"))
    ids = torch.zeros(2, 16, dtype=torch.long)
    text = fxspeed.plan(model, 1, fxspeed.Config(), example_inputs=(ids, ids)).summary()
    assert " 0.000 " not in text and "kB" in text and "GFLOP" in text


def test_a_plan_for_cuda_devices_of_a_model_on_the_cpu_says_it_traced_the_cpu_program() -> None:
    """Without a GPU the CUDA program cannot be traced (a CPU-only torch aborts functionalizing
    fake CUDA tensors), so the plan says which kernels it leaves out; a CPU plan says nothing."""
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=16))
    x = torch.zeros(2, 16, dtype=torch.long)
    gpu = fxspeed.plan(model, fxspeed.devices("H100-80GB", 1), fxspeed.Config(precision="bf16"), example_inputs=(x, x))
    cpu = fxspeed.plan(model, 1, fxspeed.Config(precision="bf16"), example_inputs=(x, x))
    assert any("not in this plan" in n for n in gpu.notes) and not any("not in this plan" in n for n in cpu.notes)


def test_plan_flops_count_cpu_attention_which_torchs_registry_has_no_formula_for() -> None:
    """A plan traced on a CPU (any plan made off a GPU) reads CPU flash attention, which torch's
    flop registry does not know: attention counted 0 (5-15% of a transformer's FLOPs at 1-4k
    tokens). The plan's total is the matmuls' (FlopCounterMode on eager) plus sdpa's formulas."""
    from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

    from fxspeed.models import GPT, GPTConfig

    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=32)
    model, x = GPT(cfg), torch.randint(0, 64, (2, 32))
    with FlopCounterMode(display=False) as fc:
        model(x, x).backward()
    assert set(map(str, fc.get_flop_counts()["Global"])) <= {"aten.mm", "aten.addmm", "aten.bmm"}
    shape = (2, 2, 32, 16)  # [B, heads, S, head_dim]
    attention = cfg.n_layer * (sdpa_flop_count(shape, shape, shape) + sdpa_backward_flop_count(shape, shape, shape, shape))
    p = fxspeed.plan(model, fxspeed.devices("H100-80GB", 1), fxspeed.Config(), example_inputs=(x, x))
    assert p.flops["total"] == fc.get_total_flops() + attention


def test_a_grouped_matmul_of_moe_experts_counts_two_flops_per_multiply_add() -> None:
    """torch._grouped_mm (HF's MoE experts) has no formula in torch's registry: experts counted 0.
    Tokens routed to 3 experts, 4 each: the FLOPs of the three matmuls, and of the weight gradient's
    2-D x 2-D form (the groups split the contracted dim)."""
    import torch.fx as fx

    from fxspeed.compiler.annotate import node_flops

    def flops(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> int:
        g = fx.Graph()
        x, w = g.placeholder("a"), g.placeholder("b")
        x.meta["val"], w.meta["val"] = a, b
        n = g.call_function(torch.ops.aten._grouped_mm.default, (x, w))
        n.meta["val"] = out
        return node_flops(n)

    assert flops(torch.empty(12, 8), torch.empty(3, 8, 5), torch.empty(12, 5)) == 3 * 2 * 4 * 8 * 5
    # dW_e = x_e^T g_e for each expert: [8, 12] x [12, 5] -> [3, 8, 5], the 12 tokens split 4/4/4
    assert flops(torch.empty(8, 12), torch.empty(12, 5), torch.empty(3, 8, 5)) == 2 * 12 * 8 * 5


@pytest.mark.parametrize("zero,devices", [(0, 1), (3, 2), (2, 4)])
def test_the_plotted_timeline_peaks_at_the_plans_step_phase_peak(zero: int, devices: int) -> None:
    """plot_timeline drew the traced graph's own bytes (full-size weights, no optimizer states or
    buffers): a ZeRO-3 plot peaked at another number than plan.memory. It draws the rank's bytes
    under the strategy now, whose maximum is the step phase's peak."""
    import matplotlib

    matplotlib.use("Agg")
    from fxspeed.tools import viz

    model = GPT(GPTConfig(vocab_size=128, block_size=32, n_layer=2, n_head=2, n_embd=32))
    ids = torch.zeros(4, 32, dtype=torch.long)
    plan = fxspeed.plan(model, devices, fxspeed.Config(zero=zero), example_inputs=(ids, ids))
    step = plan.phase_memory["step"]
    assert max(plan.timeline["rank_bytes"]) == pytest.approx(step.get("total", sum(step.values())), abs=8)
    ax = viz.plot_timeline(plan)
    assert "rank 0" in ax.get_ylabel()


def test_two_buckets_in_flight_are_the_two_largest_not_the_largest_twice() -> None:
    """One parameter that dominates (GPT-2's tied 98 MiB embedding among 25 MiB buckets) made the
    plan hold two copies of its bucket in flight, for gradients and again for ZeRO-3's gathers: a
    ZeRO-3 fp32 plan 1.4x the tensors measured at its peak."""
    from fxspeed.planner.estimate import GraphCosts, gradient_buckets, two_buckets

    mib = 2**20
    order = [(10 * mib, "torch.float32")] * 5 + [(98 * mib, "torch.float32")]
    costs = GraphCosts(step={}, param_bytes=148 * mib, trainable_bytes=148 * mib, largest_param=98 * mib,
                       largest_trainable=98 * mib, n_params=0, n_trainable=0, flops={}, times={},
                       gradient_order=order)
    assert gradient_buckets(costs, 25 * mib) == [30 * mib, 118 * mib]  # closed at >= the limit
    assert two_buckets(costs, 25 * mib) == 148 * mib
    assert two_buckets(costs, 200 * mib) == 148 * mib  # one bucket of everything: not twice it
    costs.gradient_order = order[:1] * 3 + [(98 * mib, "torch.bfloat16")]  # a dtype change closes a bucket
    assert gradient_buckets(costs, 25 * mib) == [30 * mib, 98 * mib]
    costs.gradient_order = []  # costs without an order: two buckets of the limit, as before there was one
    assert two_buckets(costs, 25 * mib) == 50 * mib and two_buckets(costs, 200 * mib) == 2 * 148 * mib


def test_a_bucket_stepped_inside_backward_is_planned_with_its_shards_own_gradient_beside_the_reduced_buckets() -> None:
    """fxspeed::step_buckets gives the optimizer this rank's shard of a reduced bucket as a tensor
    of its own, in the dtype of what it steps (FlatParameters.set_grads), while the program still
    holds the reduced bucket and the next one is in flight. Under bf16 master weights that is the
    fp32 master's gradient, one working bucket at two ranks, which the plan did not count: bf16
    ZeRO-1 (GPT 19M, 2 gloo ranks, 2 x 8 tokens) peaked at 247 MB measured, 209 planned (ZeRO-2:
    237 vs 199)."""
    from fxspeed.ir import BACKWARD, COMM_BUFFERS, FORWARD
    from fxspeed.planner.estimate import GraphCosts, bucket_step_copy, step_peak, step_phase

    mib = 2**20
    # bf16 gradients in buckets of 30 and 20 MiB (bucket_mb=25), stepped inside backward; fp32 masters
    order = [(10 * mib, "torch.bfloat16")] * 5
    live = {PARAMETERS: 50 * mib}
    costs = GraphCosts(step=dict(live), param_bytes=50 * mib, trainable_bytes=50 * mib, largest_param=10 * mib,
                       largest_trainable=10 * mib, n_params=25 * mib, n_trainable=25 * mib, flops={}, times={},
                       master_bytes=100 * mib, grad_bytes=50 * mib, stepped_grad_bytes=50 * mib,
                       gradient_order=order, phase_steps={FORWARD: dict(live), BACKWARD: dict(live)},
                       backward_front=[(30 * mib, {**live, GRADIENTS: 30 * mib}), (50 * mib, dict(live))])
    bf16 = {z: fxspeed.Config(zero=z, precision="bf16") for z in (1, 2, 3)}
    assert bucket_step_copy(costs, bf16[1], 2) == 30 * mib  # 15 Mi bf16 elements: half of them in fp32
    assert bucket_step_copy(costs, bf16[1], 4) == 15 * mib
    assert bucket_step_copy(costs, bf16[2], 2) == 30 * mib  # the reduce-scattered bf16 shard upcast
    # the first bucket is stepped once the second is complete: nothing stepped at 30 MiB made
    assert bucket_step_copy(costs, bf16[1], 2, made=30 * mib) == 0
    assert bucket_step_copy(costs, bf16[1], 1) == 0  # one replica: no buckets reduced
    # the masters in the offloaded optimizer's file: ZeRO-1 copies a working-precision shard, ZeRO-2 none
    offload = {z: fxspeed.Config(zero=z, precision="bf16", offload="optimizer") for z in (1, 2)}
    assert bucket_step_copy(costs, offload[1], 2) == 15 * mib and bucket_step_copy(costs, offload[2], 2) == 0
    fp32 = GraphCosts(**{**costs.__dict__, "gradient_order": [(20 * mib, "torch.float32")] * 5, "master_bytes": 0.0})
    assert bucket_step_copy(fp32, fxspeed.Config(zero=1), 2) == 20 * mib  # a copy of the shard of a 40 MiB bucket
    assert bucket_step_copy(fp32, fxspeed.Config(zero=2), 2) == 0  # the reduced shard itself
    stepped_after = GraphCosts(**{**costs.__dict__, "stepped_grad_bytes": 0.0})
    assert bucket_step_copy(stepped_after, bf16[1], 2) == 0  # set_grads after the program: the optimizer phase's
    # The step phase's peak, at backward's end: bf16 weights 50, the copy 30, masters 50 and
    # moments 100, the two buckets 50 MiB
    peak = step_peak(costs, bf16[1], 2)
    assert (peak[GRADIENTS], peak[COMM_BUFFERS], sum(peak.values())) == (30 * mib, 50 * mib, 280 * mib)
    # ZeRO-3 steps a bucket after the last reader of its gathered weights: the copy (30 MiB) takes
    # the place of that gathered bucket among the two in flight (the weights' 50 MiB of bf16)
    end = step_phase(live, costs, bf16[3], 2, made=50 * mib)
    assert (end[GRADIENTS], end[COMM_BUFFERS], sum(end.values())) == (0, 100 * mib, 275 * mib)


def test_a_zero2_bucket_flatten_is_planned_with_its_full_gradients_beside_the_workspace_they_are_copied_into() -> None:
    """At a complete bucket's `cat` over several replicas its gradients are still full-size and
    the flat buffer they go into is live too; under ZeRO-2 that buffer is reuse_buffers'
    workspace, as large as the largest bucket from the first flatten on (ZeRO-3 shares it with
    the gathered parameter buckets it counts already). The plan capped the
    buckets in flight at the bytes made (one copy of the first bucket, which the planned
    gradients count at 1/dp): fp32 ZeRO-2, HF Llama 18M on 2 ranks, 11 MB over the plan there."""
    from fxspeed.ir import BACKWARD, COMM_BUFFERS, FORWARD
    from fxspeed.planner.estimate import GraphCosts, step_phase

    mib = 2**20
    order = [(10 * mib, "torch.float32")] * 3 + [(40 * mib, "torch.float32")]  # buckets of 30 and 40 MiB
    live = {PARAMETERS: 70 * mib, GRADIENTS: 30 * mib}
    costs = GraphCosts(step=dict(live), param_bytes=70 * mib, trainable_bytes=70 * mib, largest_param=40 * mib,
                       largest_trainable=40 * mib, n_params=0, n_trainable=0, flops={}, times={},
                       grad_bytes=70 * mib, gradient_order=order, phase_steps={FORWARD: dict(live), BACKWARD: dict(live)})
    z2, z1 = fxspeed.Config(zero=2), fxspeed.Config(zero=1)
    assert step_phase(live, costs, z2, 2, made=20 * mib)[COMM_BUFFERS] == 20 * mib  # the first bucket filling
    # complete: its 30 MiB of gradients (15 of them counted as the rank's shard) and the 40 MiB workspace
    assert step_phase(live, costs, z2, 2, made=30 * mib)[COMM_BUFFERS] == (30 + 40 - 15) * mib
    assert step_phase(live, costs, z2, 4, made=30 * mib)[COMM_BUFFERS] == (30 + 40 - 7.5) * mib
    # ZeRO-1 flattens into a fresh bucket; the planned gradients hold the whole bucket: one more copy
    assert step_phase(live, costs, z1, 2, made=30 * mib)[COMM_BUFFERS] == 30 * mib
    # both complete: the last one's flatten (40 + 40 - 20) and no longer the first's
    assert step_phase(live, costs, z2, 2, made=70 * mib)[COMM_BUFFERS] == 70 * mib
    assert step_phase(live, costs, fxspeed.Config(zero=3), 2, made=30 * mib)[COMM_BUFFERS] == (30 + 70) * mib


def test_one_replica_with_offloaded_master_weights_plans_the_flat_bucket_beside_its_gradients() -> None:
    """One rank keeps a flat layout when its optimizer states are offloaded under bf16 (masters in
    the file): reduce_gradients flattens each complete bucket of gradients (cat, no collective)
    before stepping it, while the gradients it was made from are still held. The plan counted no
    bucket on one rank: GPT 19M, bf16, offload="optimizer", 2 x 8 tokens, measured 187 MB, planned
    133 (0.71x); the flat bucket is 27 MB of the difference (the rest is the process's own memory)."""
    from fxspeed.ir import BACKWARD, COMM_BUFFERS, FORWARD
    from fxspeed.planner.estimate import GraphCosts, step_phase

    mib = 2**20
    order = [(10 * mib, "torch.bfloat16")] * 5  # buckets of 30 and 20 MiB at bucket_mb=25
    live = {PARAMETERS: 50 * mib, GRADIENTS: 30 * mib}
    costs = GraphCosts(step=dict(live), param_bytes=50 * mib, trainable_bytes=50 * mib, largest_param=10 * mib,
                       largest_trainable=10 * mib, n_params=25 * mib, n_trainable=25 * mib, flops={}, times={},
                       master_bytes=100 * mib, grad_bytes=50 * mib, stepped_grad_bytes=50 * mib,
                       gradient_order=order, phase_steps={FORWARD: dict(live), BACKWARD: dict(live)})
    config = fxspeed.Config(zero=1, precision="bf16", offload="optimizer", nvme_path="/tmp")
    assert step_phase(live, costs, config, 1, made=20 * mib)[COMM_BUFFERS] == 0  # no bucket complete yet
    assert step_phase(live, costs, config, 1, made=30 * mib)[COMM_BUFFERS] == 30 * mib
    assert step_phase(live, costs, config, 1)[COMM_BUFFERS] == 30 * mib  # the largest, without an order in time
    assert step_phase(live, costs, config, 1, in_backward=False)[COMM_BUFFERS] == 0  # forward: none
    fp32 = GraphCosts(**{**costs.__dict__, "master_bytes": 0.0})
    assert step_phase(live, fp32, fxspeed.Config(), 1)[COMM_BUFFERS] == 0  # one rank, no flat layout
    # a real plan: one rank, bf16, optimizer offload -> a bucket of the model's bf16 gradients
    model = GPT(GPTConfig(vocab_size=256, block_size=16, n_layer=2, n_head=2, n_embd=64))
    ids = torch.zeros(2, 16, dtype=torch.long)
    plan = fxspeed.plan(model, 1, config, example_inputs=(ids, ids))
    grads = sum(p.numel() * 2 for p in model.parameters())
    assert plan.memory(0)[COMM_BUFFERS] == pytest.approx(grads, rel=0.05)  # one bucket holds them all


def test_gradient_buckets_in_flight_hold_no_more_than_backward_has_made_so_far() -> None:
    """A replica's buckets were counted at backward's peak whatever it had made by then: where
    activations peak at backward's start (a large vocabulary's logits), ZeRO-1/2/3 planned two
    buckets that do not exist yet (HF GPT-2, 2 ranks, ZeRO-3 fp32: 865 MiB planned, 795 now, 739
    of tensors measured). ZeRO-0 reduces into persistent buckets, there from backward's start."""
    from fxspeed.ir import COMM_BUFFERS
    from fxspeed.planner.memory import backward_front

    model = GPT(GPTConfig(vocab_size=4096, block_size=64, n_layer=2, n_head=2, n_embd=32))
    ids = torch.zeros(8, 64, dtype=torch.long)
    comm = {z: fxspeed.plan(model, 2, fxspeed.Config(zero=z), example_inputs=(ids, ids)).memory(0)[COMM_BUFFERS]
            for z in (0, 1, 3)}
    params = sum(p.numel() * 4 for p in model.parameters())
    assert comm[0] == pytest.approx(params, rel=0.01)  # one bucket of every gradient (all < bucket_mb)
    assert comm[1] == 0  # the peak is the loss's backward: no gradient made yet
    assert comm[3] == pytest.approx(params, rel=0.01)  # the gathered weights only
    # each amount made keeps its largest node, and only while no later node has more
    front = backward_front([("forward", 0, {"a": 20}, 20), ("backward", 0, {"a": 9}, 9), ("backward", 4, {"a": 6}, 6),
                            ("backward", 4, {"a": 7}, 7), ("backward", 6, {"a": 1}, 1), ("backward", 8, {"a": 2}, 2)])
    assert front == [(0, {"a": 9}), (4, {"a": 7}), (8, {"a": 2})]


def test_zero0_counts_its_persistent_buckets_beyond_the_gradients_made_not_two_buckets_everywhere() -> None:
    """ZeRO-0 flattens each bucket into a persistent buffer (reuse_grad_buckets) that the rank holds
    all step; the planned program holds each gradient from when it is made. Two buckets in flight
    had been counted everywhere: short by the rest at backward's start, one bucket over at its end
    (19M GPT, fp32, 2 ranks, offload="optimizer": 251.7 MB planned, 214-216 measured)."""
    from fxspeed.ir import COMM_BUFFERS
    from fxspeed.planner.estimate import buckets_not_made, gradient_buckets, trace_costs
    from fxspeed.devices import normalize_devices

    model = GPT(GPTConfig(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=256))
    ids = torch.zeros(2, 8, dtype=torch.long)
    config = fxspeed.Config(zero=0, bucket_mb=0.5)
    costs, _, _ = trace_costs(model, (ids, ids), {}, config=config, devices=normalize_devices(2))
    sizes = gradient_buckets(costs, 0.5 * 2**20)
    assert len(sizes) >= 6 and sizes[-1] < max(sizes)
    assert buckets_not_made(costs, 0.5 * 2**20, 0.0) == sum(sizes)  # forward: every bucket
    assert buckets_not_made(costs, 0.5 * 2**20, sizes[0] / 2) == sum(sizes)  # the first one being filled
    assert buckets_not_made(costs, 0.5 * 2**20, sum(sizes)) == sizes[-1]
    # a small batch peaks at backward's end: the last bucket beyond every gradient, not the two largest
    comm = fxspeed.plan(model, 2, config, example_inputs=(ids, ids)).memory(0)[COMM_BUFFERS]
    assert comm == pytest.approx(sizes[-1], abs=1)
    # a model given in bf16, reduced in bf16: its own dtype, so persistent buckets too (were two in flight)
    low = fxspeed.Config(zero=0, bucket_mb=0.5, reduce_dtype="bf16")
    model16 = copy.deepcopy(model).bfloat16()
    costs16, _, _ = trace_costs(model16, (ids, ids), {}, config=low, devices=normalize_devices(2))
    comm16 = fxspeed.plan(model16, 2, low, example_inputs=(ids, ids)).memory(0)[COMM_BUFFERS]
    assert comm16 == pytest.approx(gradient_buckets(costs16, 0.5 * 2**20)[-1], abs=1)


def test_a_cpu_add_of_two_dtypes_counts_the_copy_torch_makes_of_the_narrower_operand() -> None:
    """CPU TensorIterator copies a bf16 operand to fp32 before adding it to an fp32 one (a 98 MiB
    add of the tied embedding's two gradients peaked 196 MiB above its inputs)."""
    from fxspeed.ir import op_workspace

    gm = make_fx(lambda a, b, c: (a + b, b + c), tracing_mode="fake")(
        torch.randn(64, 8).bfloat16(), torch.randn(64, 8), torch.randn(64, 8))
    adds = [n for n in gm.graph.nodes if n.target is torch.ops.aten.add.Tensor]
    assert [op_workspace(n) for n in adds] == [64 * 8 * 4, 0]


def test_max_size_refuses_a_dim_not_marked_dynamic_and_a_fit_that_missed_its_check_point():
    """An unmarked symbol ran the search to 2**40 - 1. A fit across the chunked cross-entropy's
    switch (64 MiB of logits, on at batch 32, off at 16) had memory falling with the batch, and
    max_size answered 93550 rows for 400 MB where a plan at that size needs 419 GB."""
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=4000, block_size=256, n_layer=1, n_head=2, n_embd=32))
    ids = torch.zeros(32, 256, dtype=torch.long, device="meta")
    plan = fxspeed.plan(model, 1, example_inputs=(ids, ids), dynamic={0: {0: "batch"}, 1: {0: "batch"}})
    with pytest.raises(fxspeed.ConfigError, match=r"\['seq'\] is not a dynamic dim"):
        plan.max_size("seq", 400e6)
    assert plan.symbolic_error > 0.01 and any("misses the check point" in n for n in plan.notes)
    with pytest.raises(fxspeed.ConfigError, match="missed its check point"):
        plan.max_size("batch", 400e6)


def test_a_fit_point_the_model_refuses_is_said_to_be_the_fits_size_not_the_examples():
    """Marking the inputs' batch dim but not the (flattened) labels' failed with the model's own
    "check the example inputs' shapes", at a size the fit chose."""
    class Flat(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(16, 16)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return nn.functional.cross_entropy(self.emb(x).flatten(0, 1), y)

    x, y = torch.zeros(8, 4, dtype=torch.long), torch.zeros(32, dtype=torch.long)
    with pytest.raises(fxspeed.ConfigError, match=r"at batch=4 \(example: batch=8\) the model refused them"):
        fxspeed.plan(Flat(), 1, example_inputs=(x, y), dynamic={0: {0: "batch"}})


def test_gradient_accumulation_plans_the_earlier_slices_gradients_the_step_keeps() -> None:
    """A step of grad_accum slices keeps the earlier slices' gradients while the next slice runs
    (ZeRO-0/1 over replicas: their unreduced flat buckets; ZeRO-2/3: the reduced shards). The plan,
    of one slice's program, counted none: the same at grad_accum=2 as at 1 (GPT 6 x 512, 2 ranks,
    fp32 ZeRO-1, 2 x 64 tokens a slice: measured 267 MB at grad_accum=1, 447 at 2; planned 268 and 300,
    now 376)."""
    from fxspeed.ir import GRADIENTS

    model = GPT(GPTConfig(vocab_size=256, block_size=16, n_layer=2, n_head=2, n_embd=128))
    grads = sum(p.numel() * 4 for p in model.parameters())

    def gradients(zero: int, accum: int) -> int:
        ids = torch.zeros(2 * accum, 16, dtype=torch.long)  # the same slice either way
        cfg = fxspeed.Config(zero=zero, grad_accum=accum, disable_passes=("step_in_backward", "step_buckets_in_backward"))
        return fxspeed.plan(model, 2, cfg, example_inputs=(ids, ids)).memory(0)[GRADIENTS]

    for zero, kept in ((0, grads), (1, grads), (2, grads / 2), (3, grads / 2)):
        assert gradients(zero, 2) - gradients(zero, 1) == pytest.approx(kept, rel=1e-6), zero
