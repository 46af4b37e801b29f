"""fxspeed.plan under pipeline parallelism: the program the engine would run (one micro-batch cut
into stages and scheduled) is planned on fake tensors, per stage and per rank.

The acceptance check measures from outside fxspeed: each of 2 gloo ranks trains the GPT with
fxspeed.compile(Config(pipeline=2, microbatches=4)) and reports its peak RSS growth
(tests/workers/pipeline_memory_worker.py: VmHWM after clear_refs, the baseline taken after a
warm-up and before the model is built, so the weights the rank keeps count). The plan of the same
model built on the meta device must predict each rank's peak within 15%.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import fxspeed
from fxspeed.errors import ConfigError
from fxspeed.models import GPT, GPTConfig
from fxspeed.passes.program.lower_schedule import make
from fxspeed.planner import finish_plan
from fxspeed.planner.simulator import Costs, StageCosts, simulate
from tests.multiprocess import rank_env, run_ranks

ROOT = Path(__file__).resolve().parents[1]
SMALL = GPTConfig(vocab_size=512, block_size=32, n_layer=4, n_head=4, n_embd=64)


def meta_gpt(cfg: GPTConfig = SMALL) -> GPT:
    with torch.device("meta"):
        return GPT(cfg)


def batch(cfg: GPTConfig = SMALL, rows: int = 8, seq: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x, y = (torch.randint(0, cfg.vocab_size, (rows, seq), generator=g) for _ in range(2))
    return x, y


@pytest.fixture(scope="module")
def plan2() -> fxspeed.Plan:
    return fxspeed.plan(meta_gpt(), 2, fxspeed.Config(pipeline=2, microbatches=4), example_inputs=batch())


def test_plan_of_a_meta_gpt_with_pipeline_2_has_two_stages_with_modules_params_and_memory(plan2) -> None:
    pp = plan2.pipeline
    assert pp["stages_n"] == 2 and [st["rank"] for st in pp["stages"]] == [0, 1]
    first, last = (st["modules"] for st in pp["stages"])
    assert first[:2] == ["wte", "wpe"] and first[-1].startswith("blocks.")
    assert last[0].startswith("blocks.") and last[-2:] == ["ln_f", "head"]
    n_params = sum(p.numel() for p in meta_gpt().parameters())
    assert sum(st["params"] for st in pp["stages"]) == n_params + SMALL.vocab_size * SMALL.n_embd  # tied: on both
    for st in pp["stages"]:
        m = st["memory_bytes"]
        assert m["parameters"] > 0 and m["gradients"] == m["parameters"] and m["activations"] > 0
        assert m["optimizer_states"] == 2 * m["gradients"]  # AdamW
        assert st["forward_s"] > 0 and st["backward_s"] > 0  # predicted on fake tensors too
    assert plan2.strategy["pp"] == 2 and plan2.strategy["dp"] == 1 and plan2.config["pipeline"] == 2


def test_the_bubble_is_the_simulators_for_the_stages_predicted_times(plan2) -> None:
    pp = plan2.pipeline
    costs = Costs([StageCosts(st["forward_s"], st["backward_s"], 0.0) for st in pp["stages"]])
    sim = simulate(make("1f1b", 2, 4), costs)
    assert pp["schedule"] == "1f1b" and pp["microbatches"] == 4
    assert pp["bubble"] == pytest.approx(sim.bubble, rel=1e-12) and 0 < pp["bubble"] < 1
    assert pp["step_s"] == pytest.approx(sim.step_time, rel=1e-12)
    t = plan2.time
    assert t["forward"] + t["backward"] + t["bubble"] == pytest.approx(sim.step_time)
    assert t["total"] == pytest.approx(sim.step_time + t["optimizer"] + t["communication"])


def test_each_rank_gets_its_own_stage_memory_and_the_larger_phase_is_its_peak(plan2) -> None:
    ranks = plan2.pipeline["ranks"]
    assert len(plan2.rank_memory) == 2 and len(plan2.devices) == 2
    for g in range(2):
        mem = plan2.memory(g)
        stage = plan2.pipeline["stages"][g]["memory_bytes"]
        assert mem["parameters"] == stage["parameters"] and mem["optimizer_states"] == stage["optimizer_states"]
        phases = ranks[g]["phase_memory"]
        assert mem["total"] == max(sum(phases["step"].values()), sum(phases["optimizer"].values()))
        assert plan2.peak_phase[g] == ranks[g]["peak_phase"]
        assert mem["activations"] > 0  # the step phase peaks: saved activations are on top of the states
    assert plan2.memory(0)["total"] != plan2.memory(1)["total"]


def test_summary_shows_both_stages_each_ranks_peak_and_the_rank_layout(plan2) -> None:
    text = plan2.summary()
    assert "pipeline: 2 stages, schedule 1f1b, 4 micro-batches" in text
    assert "position 0 (stages 0): peak" in text and "position 1 (stages 1): peak" in text
    assert "mesh dp=1 x pp=2 x tp=1 over 2 rank(s)" in text
    assert "rank 0: dp 0, pp 0, tp 0" in text and "rank 1: dp 0, pp 1, tp 0" in text
    assert "wte, wpe" in text and "ln_f, head" in text
    assert fxspeed.Plan.from_json(plan2.to_json()).to_dict() == plan2.to_dict()


def test_two_pipelines_of_two_stages_lay_ranks_out_as_the_mesh_does() -> None:
    plan = fxspeed.plan(meta_gpt(), 4, fxspeed.Config(pipeline=2, microbatches=2, zero=1), example_inputs=batch())
    assert plan.strategy["dp"] == 2 and plan.strategy["pp"] == 2
    assert plan.rank_memory[0] == plan.rank_memory[2] and plan.rank_memory[1] == plan.rank_memory[3]
    assert plan.rank_memory[0] != plan.rank_memory[1]
    assert "rank 2: dp 1, pp 0, tp 0" in plan.summary() and "rank 3: dp 1, pp 1, tp 0" in plan.mesh
    # The stage table names each stage's pipeline position, not a rank: ranks 1 and 3 run stage 1
    # here, ranks 2 and 6 at tensor=2 x pipeline=2 x 2 replicas, where it said "rank 1" (a tp rank
    # of position 0).
    assert "stage  position" in plan.summary() and "stage  rank" not in plan.summary()
    assert [st["position"] for st in plan.pipeline["stages"]] == [0, 1]
    one = fxspeed.plan(meta_gpt(), 2, fxspeed.Config(pipeline=2, microbatches=2), example_inputs=batch())
    # ZeRO-1 halves the optimizer states over the 2 replicas of a stage
    assert 2 * plan.memory(0)["optimizer_states"] == one.memory(0)["optimizer_states"]


def test_a_meta_model_and_the_same_model_on_the_cpu_get_the_same_pipeline_plan(plan2) -> None:
    torch.manual_seed(0)
    cpu = fxspeed.plan(GPT(SMALL), 2, fxspeed.Config(pipeline=2, microbatches=4), example_inputs=batch())
    assert cpu.rank_memory == plan2.rank_memory and cpu.pipeline["stages"] == plan2.pipeline["stages"]


def test_every_schedule_is_planned_and_zero_bubble_holds_inputs_until_w() -> None:
    peaks = {}
    for sched in ("gpipe", "1f1b", "zb", "interleaved"):
        p = fxspeed.plan(meta_gpt(), 2, fxspeed.Config(pipeline=2, microbatches=4, schedule=sched),
                         example_inputs=batch())
        assert p.pipeline["stages_n"] == (4 if sched == "interleaved" else 2)
        peaks[sched] = [p.pipeline["ranks"][r]["phase_memory"]["step"]["activations"] for r in range(2)]
    # GPipe keeps every micro-batch's activations until its backward; 1F1B at most P on position 0.
    assert peaks["gpipe"][0] > peaks["1f1b"][0]


def test_finish_plan_records_the_mesh_shape_it_is_given() -> None:
    plan = fxspeed.plan(meta_gpt(), 1, fxspeed.Config(), example_inputs=batch())
    assert plan.strategy["pp"] == 1 and plan.strategy["tp"] == 1 and plan.mesh == ""
    from fxspeed.compiler import compile_step
    from fxspeed.devices import normalize_devices
    from fxspeed.planner import costs_reader

    devs = normalize_devices(4)
    c = compile_step(meta_gpt(), batch(), {}, config=fxspeed.Config(), loss_fn=None,
                     analyze=costs_reader(fxspeed.Config(), devs))
    p = finish_plan(c.costs, model_name="GPT", config=fxspeed.Config(), devices=devs, passes=[], pp=2)
    assert (p.strategy["dp"], p.strategy["pp"], p.strategy["tp"]) == (2, 2, 1)
    assert "rank 3: dp 1, pp 1, tp 0" in p.mesh
    old = finish_plan(c.costs, model_name="GPT", config=fxspeed.Config(), devices=devs, passes=[])
    assert old.strategy["dp"] == 4 and old.strategy["pp"] == 1


def test_planning_a_pipeline_refuses_what_it_cannot_plan_with_what_works() -> None:
    with pytest.raises(ConfigError, match=r"devices=3 is not a multiple of Config.pipeline x Config.tensor"):
        fxspeed.plan(meta_gpt(), 3, fxspeed.Config(pipeline=2, microbatches=4), example_inputs=batch())
    with pytest.raises(ConfigError, match=r"microbatches=3 must divide the batch dimension"):
        fxspeed.plan(meta_gpt(), 2, fxspeed.Config(pipeline=2, microbatches=3), example_inputs=batch())
    with pytest.raises(ConfigError, match=r"dynamic dims are not supported with Config.pipeline=2"):
        fxspeed.plan(meta_gpt(), 2, fxspeed.Config(pipeline=2, microbatches=4), example_inputs=batch(),
                     dynamic={0: {0: "batch"}})


# --------------------------------------------------------------------------------------------
# Acceptance: the plan against the kernel's peak RSS of 2 gloo ranks
# --------------------------------------------------------------------------------------------

def measure(out: Path, *extra: str) -> dict[int, dict]:
    env = rank_env(MALLOC_MMAP_THRESHOLD_="65536", FXSPEED_BACKEND="gloo")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "tests.workers.pipeline_memory_worker", "--out", str(out), *extra]
    proc = run_ranks(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-6000:]
    recs = [json.loads(p.read_text()) for p in out.glob("pipe_mem_rank*.json")]
    return {r["rank"]: r for r in recs}


@pytest.mark.slow
def test_planned_peak_of_each_rank_is_within_15_percent_of_its_measured_peak_rss_under_pipeline_2(
        tmp_path: Path) -> None:
    recs = measure(tmp_path)
    r0 = recs[0]
    cfg = GPTConfig(**r0["model"])
    rows, seq = r0["batch"]
    x = torch.zeros(rows, seq, dtype=torch.int64)
    plan = fxspeed.plan(meta_gpt(cfg), 2, fxspeed.Config(pipeline=2, microbatches=r0["microbatches"],
                                                           schedule=r0["schedule"]), example_inputs=(x, x))
    report = []
    for rank in (0, 1):
        rec = recs[rank]
        predicted, measured = plan.peak_memory(rank), rec["peak_bytes"]
        mem = plan.memory(rank)
        # Above the steady state (weights, gradient buffers, optimizer states after a step): what
        # the action list keeps alive (activations, messages, program temporaries).
        walked = predicted - mem["parameters"] - mem["gradients"] - mem["optimizer_states"]
        above = measured - rec["steps"][-1]["rss"]
        report.append(f"rank {rank}: predicted {predicted / 1e6:.1f} MB, measured {measured / 1e6:.1f} MB; above the "
                      f"steady state predicted {walked / 1e6:.1f} MB, measured {above / 1e6:.1f} MB")
        assert predicted - walked > 100e6  # tens of MB of model states per rank: the process's own noise is small
        assert abs(predicted - measured) <= 0.15 * measured, report
        assert abs(walked - above) <= 0.15 * above, report
        if rec["engine_plan"] is not None:  # the engine plans its own rank with the same functions
            assert rec["engine_plan"]["total"] == predicted, report
    print("\n".join(report))


def test_an_extrapolated_pipeline_cuts_where_the_whole_trace_does_even_leaving_a_stage_no_block() -> None:
    """A head far heavier than a block (a 32k vocabulary over width 128): the whole trace's
    balanced cut puts all 8 blocks on stage 0 and the head alone on stage 1. The extrapolated
    cut started every stage at one block (7/1, a program the engine would not run: its peaks 7%
    and 8% off); it starts from none now."""
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=8,
                                             num_attention_heads=2, num_key_value_heads=2, vocab_size=32000))
    ids = torch.zeros(2, 1024, dtype=torch.long)
    plans = [fxspeed.plan(model, 2, fxspeed.Config(pipeline=2, microbatches=2, layer_extrapolation=e),
                          example_inputs=((), {"input_ids": ids, "labels": ids})) for e in (True, False)]
    cuts = [[sum(m.startswith("model.layers.") for m in st["modules"]) for st in p.pipeline["stages"]] for p in plans]
    assert cuts[0] == cuts[1] == [8, 0]
    for r in range(2):
        assert plans[0].peak_memory(r) == pytest.approx(plans[1].peak_memory(r), rel=0.015)


class _Named(nn.Module):
    """Top-level modules that are not a numbered block stack, and a bias-free head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.l1, self.l2 = nn.Linear(32, 32), nn.Linear(32, 32)
        self.head = nn.Linear(32, 64, bias=False)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.l2(torch.tanh(self.l1(self.emb(x)))))
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1), y.flatten())


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_split_points_name_any_module_in_every_precision_and_a_bias_free_head(precision: str) -> None:
    """Under bf16 a matmul reads a cast of its weight, and a bias-free head's reads t(weight): both
    took their module from their activation input, so l1/l2 read as the embedding's under bf16
    (refused as split points, "at most 1 stages") and the head could not be named at all."""
    x = torch.randint(0, 64, (4, 8))
    for points in (["l1"], ["l2"], ["head"]):
        plan = fxspeed.plan(_Named(), 2, fxspeed.Config(pipeline=2, microbatches=2, precision=precision,
                                                       split_points=points), example_inputs=(x, x))
        assert len(plan.pipeline["stages"]) == 2, points
    fxspeed.plan(_Named(), 2, fxspeed.Config(pipeline=2, microbatches=2, precision=precision), example_inputs=(x, x))


class _NoRepeatedBlocks(nn.Module):
    """A small Sequential up front (a U-Net's time-embedding MLP), then distinct layers."""

    def __init__(self) -> None:
        super().__init__()
        self.tmlp = nn.Sequential(nn.Linear(8, 16), nn.SiLU(), nn.Linear(16, 8))
        self.a, self.b, self.c, self.d = (nn.Linear(8 if i == 0 else 256, 256) for i in range(4))
        self.out = nn.Linear(256, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.tmlp(x)
        h = self.d(torch.relu(self.c(torch.relu(self.b(torch.relu(self.a(h)))))))
        return nn.functional.mse_loss(self.out(h).squeeze(-1), y)


def test_a_model_without_repeated_blocks_is_cut_where_its_stages_balance_not_around_a_small_sequential() -> None:
    """The Sequential's layers were taken for repeated blocks and gave the only cuts: stage 0 held
    the time MLP alone (1,072 of 24,251 parameters of a U-Net, bubble 0.47)."""
    plan = fxspeed.plan(_NoRepeatedBlocks(), 2, fxspeed.Config(pipeline=2, microbatches=2),
                        example_inputs=(torch.randn(16, 8), torch.randn(16)))
    first, second = plan.pipeline["stages"]
    assert "a" in first["modules"] and "d" in second["modules"]
    assert 0.3 < first["params"] / (first["params"] + second["params"]) < 0.7
