"""torch.utils.checkpoint is honoured: checkpointed regions are tagged at capture and recomputed
in backward (passes/memory/recompute_checkpointed.py), so results equal eager and activation
memory is lower. Issue 12, item 4."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from torch.utils.checkpoint import checkpoint  # bound at import time: must be honoured too

import fxspeed
from conftest import assert_close_rel, assert_models_match, check_parity, eager_train
from fxspeed.compiler.capture import capture_step
from fxspeed.compiler.pipelines import compile_step
from fxspeed.ir import ACTIVATIONS, META_KEY
from fxspeed.models import GPT, GPTConfig

aten = torch.ops.aten
RTOL = 1e-6


def _module_attribute_checkpoint(fn, *args, **kwargs):
    return torch.utils.checkpoint.checkpoint(fn, *args, **kwargs)


CALLS = {"imported_name": checkpoint, "module_attribute": _module_attribute_checkpoint}


class Block(nn.Module):
    def __init__(self, d: int, dropout: float = 0.0):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.proj = nn.Linear(4 * d, d)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.proj(F.gelu(self.fc(self.ln(x)))))


class CheckpointedMLP(nn.Module):
    """Residual MLP blocks, each under torch.utils.checkpoint (when `checkpointed`)."""

    def __init__(self, d: int = 16, n: int = 3, checkpointed: bool = True, use_reentrant: bool = False,
                 call: str = "imported_name", dropout: float = 0.0):
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.blocks = nn.ModuleList(Block(d, dropout) for _ in range(n))
        self.head = nn.Linear(d, 1)
        self.checkpointed, self.use_reentrant, self.call = checkpointed, use_reentrant, call

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)  # a region input that requires grad (reentrant checkpoint needs one)
        for b in self.blocks:
            x = CALLS[self.call](b, x, use_reentrant=self.use_reentrant) if self.checkpointed else b(x)
        return (self.head(x).squeeze(-1) - y).pow(2).mean()


def batches(d: int = 16, n: int = 3, b: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.randn(b, d), torch.randn(b)) for _ in range(n)]


CONFIG = fxspeed.Config(lr=1e-2)


# ------------------------------------------------------------------------------------------
# (a) training equals eager
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("use_reentrant", [False, True])
@pytest.mark.parametrize("call", sorted(CALLS))
def test_checkpointed_mlp_blocks_train_three_steps_equal_to_eager(use_reentrant: bool, call: str):
    engine, _ = check_parity(CheckpointedMLP(use_reentrant=use_reentrant, call=call), batches(), CONFIG, rtol=RTOL)
    assert any(r["name"] == "recompute_checkpointed" and r["modified"] for r in engine.plan.passes)


class SequentialModel(nn.Module):
    def __init__(self, d: int = 16, n: int = 4):
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.seq = nn.Sequential(*(Block(d) for _ in range(n)))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.utils.checkpoint.checkpoint_sequential(self.seq, 2, self.inp(x), use_reentrant=False)
        return (h.sum(-1) - y).pow(2).mean()


def test_checkpoint_sequential_trains_three_steps_equal_to_eager():
    check_parity(SequentialModel(), batches(), CONFIG, rtol=RTOL)


class CheckpointedGPT(GPT):
    """fxspeed.models.GPT with every block under torch.utils.checkpoint."""

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        T = idx.shape[1]
        x = self.drop(self.wte(idx) + self.wpe(torch.arange(T, device=idx.device)))
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def test_a_gpt_with_checkpointed_blocks_trains_three_steps_equal_to_eager():
    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
    data = [(torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))) for _ in range(3)]
    check_parity(CheckpointedGPT(cfg), data, CONFIG, rtol=RTOL)


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_hugging_face_gradient_checkpointing_is_honoured_and_trains_equal_to_eager(use_reentrant: bool):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=16, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(cfg)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
    data = [dict(input_ids=i, labels=i.clone()) for i in (torch.randint(0, 64, (2, 16)) for _ in range(3))]
    engine, _ = check_parity(model, data, fxspeed.Config(lr=1e-3), rtol=1e-5)
    assert any(r["name"] == "recompute_checkpointed" and r["modified"] for r in engine.plan.passes)


# ------------------------------------------------------------------------------------------
# (b) the rewritten graph
# ------------------------------------------------------------------------------------------

def compiled(model: nn.Module, config: fxspeed.Config = fxspeed.Config()):
    return compile_step(model, batches(n=1)[0], {}, config=config, loss_fn=None)


def saved_for_backward(gm) -> list[str]:
    """Forward values backward reads (annotate's ACTIVATIONS category)."""
    return [n.name for n in gm.graph.nodes if n.meta.get(META_KEY) is not None
            and n.meta[META_KEY].category == ACTIVATIONS]


def test_capture_tags_the_nodes_of_each_checkpointed_call_with_one_region_per_call():
    cap = capture_step(CheckpointedMLP(n=3), batches(n=1)[0], {})
    regions = {n.meta["recompute"] for n in cap.gm.graph.nodes if "recompute" in n.meta}
    assert len(regions) == 3
    tagged = {n.target for n in cap.gm.graph.nodes if "recompute" in n.meta}
    assert {aten.native_layer_norm.default, aten.addmm.default, aten.gelu.default} <= tagged
    # the input layer and the head are outside every region
    plain = capture_step(CheckpointedMLP(n=3, checkpointed=False), batches(n=1)[0], {})
    assert not any("recompute" in n.meta for n in plain.gm.graph.nodes)


def test_the_rewritten_graph_recomputes_tagged_nodes_in_backward_and_saves_fewer_forward_values():
    torch.manual_seed(0)
    plain = compiled(CheckpointedMLP(checkpointed=False)).captured.gm
    torch.manual_seed(0)
    step = compiled(CheckpointedMLP())
    gm = step.captured.gm
    clones = [n for n in gm.graph.nodes if "recomputed_from" in n.meta]
    assert {n.target for n in clones} >= {aten.native_layer_norm.default, aten.addmm.default, aten.gelu.default}
    # every clone is a backward node, placed after the loss
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    loss = next(n for n in gm.graph.nodes if n.target == aten.ones_like.default)
    assert all(order[c] > order[loss] and c.meta[META_KEY].role == "backward" for c in clones)
    saved, saved_plain = saved_for_backward(gm), saved_for_backward(plain)
    assert len(saved) < len(saved_plain) / 2, (saved, saved_plain)
    rec = {r.name: r for r in step.records}
    assert rec["recompute_checkpointed"].modified


def test_recompute_checkpointed_can_be_disabled_by_name_and_does_not_run_without_checkpoints():
    torch.manual_seed(0)
    plain = compiled(CheckpointedMLP(checkpointed=False))
    assert "recompute_checkpointed" not in [r.name for r in plain.records]
    torch.manual_seed(0)
    off = compiled(CheckpointedMLP(), fxspeed.Config(disable_passes=("recompute_checkpointed",)))
    assert {r.name: r for r in off.records}["recompute_checkpointed"].skipped
    assert not any("recomputed_from" in n.meta for n in off.captured.gm.graph.nodes)
    assert len(saved_for_backward(off.captured.gm)) == len(saved_for_backward(plain.captured.gm))


def test_the_planner_sees_the_lower_activation_memory():
    x, y = torch.randn(64, 64), torch.randn(64)
    mem = {}
    for ck in (False, True):
        torch.manual_seed(0)
        plan = fxspeed.plan(CheckpointedMLP(d=64, n=4, checkpointed=ck), 1, fxspeed.Config(), example_inputs=(x, y))
        mem[ck] = plan.memory(0)["activations"]
    assert mem[True] < mem[False] / 3, mem


# ------------------------------------------------------------------------------------------
# (c) measured memory
# ------------------------------------------------------------------------------------------

MEMORY_SCRIPT = textwrap.dedent("""
    import json, resource, sys
    import torch, torch.nn as nn, torch.nn.functional as F
    from torch.utils.checkpoint import checkpoint
    import fxspeed
    torch.set_num_threads(2)
    ck, W, B, L = sys.argv[1] == "1", 256, int(sys.argv[2]), 8
    class Block(nn.Module):
        def __init__(s):
            super().__init__(); s.ln = nn.LayerNorm(W); s.fc = nn.Linear(W, 4 * W); s.proj = nn.Linear(4 * W, W)
        def forward(s, x):
            return x + s.proj(F.gelu(s.fc(s.ln(x))))
    class Model(nn.Module):
        def __init__(s):
            super().__init__(); s.blocks = nn.ModuleList(Block() for _ in range(L)); s.head = nn.Linear(W, 1)
        def forward(s, x):
            for b in s.blocks:
                x = checkpoint(b, x, use_reentrant=False) if ck else b(x)
            return s.head(x).pow(2).mean()
    torch.manual_seed(0)
    model, x = Model(), torch.randn(B, W)
    engine = fxspeed.compile(model, 1, fxspeed.Config(), example_inputs=(x,))
    def status_kb(field):
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) for l in f if l.startswith(field + ":"))
    engine.train_step(x)  # the first step allocates gradients and optimizer states
    try:  # the step's own peak: VmHWM reset to the current RSS, as docs/decisions/README.md measures
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        before = status_kb("VmRSS")
        loss = engine.train_step(x)
        after = status_kb("VmHWM")
    except OSError:  # no /proc: the process's peak, which compile() may already hold
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        loss = engine.train_step(x)
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps(dict(before_kb=before, peak_kb=after, loss=float(loss))))
""")


def peak_rss(checkpointed: bool, batch: int) -> dict:
    # glibc then returns every freed tensor to the OS, so RSS follows what is alive
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "65536"}
    r = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT, "1" if checkpointed else "0", str(batch)],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_activation_memory_of_a_training_step_is_measurably_lower_with_checkpointing():
    # 8 blocks of width 256 (fc 256 -> 1024), batch 4096: ~37 MB of saved values per block
    # without checkpointing, 4 MB (the block's input) with it; parameters are ~8 MB. Without
    # checkpointing recompute_pointwise already recomputes each GELU's output in backward (16 MB
    # a block), so the difference is about 140 MB, not 300 (225 vs 85 MB measured).
    plain, ck = peak_rss(False, 4096), peak_rss(True, 4096)
    assert plain["loss"] == pytest.approx(ck["loss"], rel=1e-6)
    grow_plain = (plain["peak_kb"] - plain["before_kb"]) / 1024
    grow_ck = (ck["peak_kb"] - ck["before_kb"]) / 1024
    print(f"peak RSS growth in the second train_step: {grow_plain:.0f} MB without checkpoint, {grow_ck:.0f} MB with "
          f"(peaks {plain['peak_kb'] / 1024:.0f} / {ck['peak_kb'] / 1024:.0f} MB)")
    assert grow_ck < 0.5 * grow_plain and grow_plain - grow_ck > 100, (grow_plain, grow_ck)


# ------------------------------------------------------------------------------------------
# (d) random models with random checkpointed sub-blocks
# ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Spec:
    depth: int  # Linear(width, width) layers
    width: int
    residual: bool
    layernorm: bool
    activation: str
    regions: tuple[tuple[int, int], ...]  # [start, end) layer ranges run under checkpoint
    reentrant: bool
    batch: int
    seed: int


ACTS = {"relu": F.relu, "gelu": F.gelu, "tanh": torch.tanh, "silu": F.silu}


class RandomModel(nn.Module):
    def __init__(self, s: Spec):
        super().__init__()
        self.s = s
        self.inp = nn.Linear(s.width, s.width)
        self.layers = nn.ModuleList(nn.Linear(s.width, s.width) for _ in range(s.depth))
        self.norms = nn.ModuleList(nn.LayerNorm(s.width) for _ in range(s.depth))

    def layer(self, i: int, x: torch.Tensor) -> torch.Tensor:
        h = ACTS[self.s.activation](self.layers[i](self.norms[i](x) if self.s.layernorm else x))
        return x + h if self.s.residual else h

    def run(self, lo: int, hi: int, x: torch.Tensor) -> torch.Tensor:
        for i in range(lo, hi):
            x = self.layer(i, x)
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        i = 0
        for lo, hi in self.s.regions:
            x = self.run(i, lo, x)
            x = checkpoint(lambda t, lo=lo, hi=hi: self.run(lo, hi, t), x, use_reentrant=self.s.reentrant)
            i = hi
        return self.run(i, len(self.layers), x).pow(2).mean()


@st.composite
def specs(draw) -> Spec:
    depth = draw(st.integers(1, 5))
    regions, i = [], 0
    while i < depth:  # at least one region; others at random, each a run of consecutive layers
        if draw(st.booleans()) or (not regions and i == depth - 1):
            n = draw(st.integers(1, depth - i))
            regions.append((i, i + n))  # may start where the previous region ended
            i += n
        else:
            i += 1
    return Spec(depth=depth, width=draw(st.integers(2, 24)), residual=draw(st.booleans()),
                layernorm=draw(st.booleans()), activation=draw(st.sampled_from(sorted(ACTS))), regions=tuple(regions),
                reentrant=draw(st.booleans()), batch=draw(st.integers(1, 6)), seed=draw(st.integers(0, 2**16)))


@settings(max_examples=20, deadline=None, derandomize=True, phases=[Phase.explicit, Phase.generate],
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(specs())
def test_random_models_with_random_checkpointed_sub_blocks_train_equal_to_eager(s: Spec):
    torch.manual_seed(s.seed)
    model = RandomModel(s)
    data = [(torch.randn(s.batch, s.width),) for _ in range(2)]
    engine, _ = check_parity(model, data, CONFIG, rtol=1e-5)
    assert "recompute_checkpointed" in [r["name"] for r in engine.plan.passes]  # the regions were seen


# ------------------------------------------------------------------------------------------
# (e) random ops inside a region
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("use_reentrant", [False, True])
def test_dropout_inside_a_checkpointed_region_equals_eager_under_the_same_seed(use_reentrant: bool):
    torch.manual_seed(0)
    model, data = CheckpointedMLP(dropout=0.3, use_reentrant=use_reentrant), batches()
    ref = copy.deepcopy(model)
    torch.manual_seed(1234)
    ref_losses = eager_train(ref, data, CONFIG)  # torch's checkpoint replays the RNG when recomputing
    torch.manual_seed(1234)
    engine = fxspeed.compile(model, 1, CONFIG, example_inputs=data[0])
    losses = [engine.train_step(*b) for b in data]
    for i, (a, b) in enumerate(zip(losses, ref_losses)):
        assert_close_rel(a, b, f"loss at step {i}", RTOL)
    assert_models_match(model, ref, RTOL)
    # and dropout really is active: the eval loss (no dropout) at the same parameters differs
    assert engine.train_step(*data[0]) != pytest.approx(engine.eval_step(*data[0]), rel=1e-4)


def test_dropout_inside_a_checkpointed_region_is_saved_not_drawn_again():
    step = compiled(CheckpointedMLP(dropout=0.3))
    gm = step.captured.gm
    drops = [n for n in gm.graph.nodes if n.target == aten.native_dropout.default]
    assert len(drops) == 3 and not any("recomputed_from" in n.meta for n in drops)
    assert any("recomputed_from" in n.meta for n in gm.graph.nodes)  # the rest of the region is recomputed


# ------------------------------------------------------------------------------------------
# data parallel and pipeline: the distributed passes run after the recompute (ZeRO-3 gathers
# the weights the clones read); a pipeline's stages are cut from the rewritten joint graph
# ------------------------------------------------------------------------------------------

DP_SCRIPT = textwrap.dedent("""
    import sys, torch, torch.distributed as dist
    sys.path.insert(0, {tests!r})
    import fxspeed
    from test_recompute_checkpointed import CheckpointedMLP, batches
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model, data = CheckpointedMLP(), batches(b=8)
    rank, world = int(__import__("os").environ["RANK"]), int(__import__("os").environ["WORLD_SIZE"])
    local = [(x.chunk(world)[rank], y.chunk(world)[rank]) for x, y in data]
    out = {{}}
    for zero in (0, 3):
        m = CheckpointedMLP(); m.load_state_dict(model.state_dict())
        engine = fxspeed.compile(m, world, fxspeed.Config(lr=1e-2, zero=zero), example_inputs=local[0])
        out[zero] = dict(losses=[engine.train_step(*b) for b in local], state=engine.state_dict(),
                         recomputed=any(p["name"] == "recompute_checkpointed" and p["modified"]
                                        for p in engine.plan.passes))
    m = CheckpointedMLP(); m.load_state_dict(model.state_dict())  # a pipeline: 2 stages x 2 micro-batches
    engine = fxspeed.compile(m, world, fxspeed.Config(lr=1e-2, pipeline=2, microbatches=2), example_inputs=data[0])
    out["pipeline"] = dict(losses=[engine.train_step(*b) for b in data], state=engine.state_dict(),
                           recomputed=any(p["name"] == "recompute_checkpointed" and p["modified"]
                                          for p in engine.plan.passes))
    if rank == 0:
        torch.save(dict(out=out), {out!r})
    dist.destroy_process_group()
""")


def test_checkpointed_blocks_under_zero_0_zero_3_and_a_pipeline_train_equal_to_one_process(tmp_path):
    from tests.multiprocess import rank_env, run_ranks

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script, out = tmp_path / "dp.py", tmp_path / "out.pt"
    script.write_text(DP_SCRIPT.format(tests=os.path.join(root, "tests"), out=str(out)))
    proc = run_ranks([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                      str(script)], cwd=root, capture_output=True, text=True, timeout=600,
                     env=rank_env(FXSPEED_BACKEND="gloo"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    got = torch.load(out)
    torch.manual_seed(0)  # the script's model and batches
    ref, data = CheckpointedMLP(), batches(b=8)
    ref_losses = eager_train(ref, data, CONFIG)
    assert set(got["out"]) == {0, 3, "pipeline"}
    for zero, res in got["out"].items():
        assert res["recomputed"], zero
        for i, (a, b) in enumerate(zip(res["losses"], ref_losses)):
            assert_close_rel(a, b, f"{zero} loss at step {i}", 1e-5)
        for k, v in ref.state_dict().items():
            assert_close_rel(res["state"][k], v, f"{zero}: {k}", 1e-5)


# ------------------------------------------------------------------------------------------
# buffers updated inside a region
# ------------------------------------------------------------------------------------------

class NormedRegion(nn.Module):
    def __init__(self, checkpointed: bool):
        super().__init__()
        self.a, self.bn, self.b = nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 1)
        self.checkpointed = checkpointed

    def region(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.bn(self.a(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = checkpoint(self.region, x, use_reentrant=False) if self.checkpointed else self.region(x)
        return self.b(h).pow(2).mean()


def test_batch_norm_inside_a_checkpointed_region_updates_its_running_stats_once_per_step():
    # Eager torch re-runs the region in backward and so updates the running stats twice per
    # step (num_batches_tracked counts 2); fxspeed recomputes the values backward reads, not
    # the buffer updates: the step equals eager without checkpointing, buffers included.
    data = [(torch.randn(16, 8),) for _ in range(3)]
    torch.manual_seed(0)
    model = NormedRegion(checkpointed=True)
    ref = NormedRegion(checkpointed=False)
    ref.load_state_dict(model.state_dict())
    ref_losses = eager_train(ref, data, CONFIG)
    engine = fxspeed.compile(model, 1, CONFIG, example_inputs=data[0])
    losses = [engine.train_step(*b) for b in data]
    for i, (a, b) in enumerate(zip(losses, ref_losses)):
        assert_close_rel(a, b, f"loss at step {i}", RTOL)
    assert_models_match(model, ref, RTOL)
    assert int(model.bn.num_batches_tracked) == 3
