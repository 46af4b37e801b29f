"""Mixed precision as passes: the cast policy seen in the compiled graph, training that
tracks fp32, fp16 loss scaling with overflow skipping, and ZeRO-3 gathers in bf16."""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import fxspeed
from fxspeed.ir import META_KEY
from fxspeed.models import GPT, GPTConfig
from fxspeed.passes.graph.insert_casts import LOW_OPS
from tests.multiprocess import run_ranks

ROOT = Path(__file__).resolve().parents[1]
aten = torch.ops.aten
FP32_OPS = {aten.native_layer_norm.default, aten.native_layer_norm_backward.default, aten._log_softmax.default,
            aten._softmax.default, aten.nll_loss_forward.default, aten.nll_loss_backward.default,
            aten.sum.dim_IntList, aten.mean.dim}
LOW = {"bf16": torch.bfloat16, "fp16": torch.float16}


def tiny_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=32))


def batch(seed: int = 0, rows: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 64, (rows, 16), generator=g)
    return x, x.clone()  # a copy task: learnable within a few dozen steps


def out_dtypes(n: torch.fx.Node) -> list[torch.dtype]:
    v = n.meta.get("val")
    vals = [v] if isinstance(v, torch.Tensor) else [t for t in (v or ()) if isinstance(t, torch.Tensor)]
    return [t.dtype for t in vals]


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_matmuls_and_attention_run_in_low_precision_while_norms_softmax_and_loss_stay_fp32(precision: str) -> None:
    x, y = batch()
    engine = fxspeed.compile(tiny_gpt(), 1, fxspeed.Config(precision=precision), example_inputs=(x, y))
    nodes = [n for n in engine.graph().graph.nodes if n.op == "call_function"]
    low_ops = [n for n in nodes if n.target in LOW_OPS]
    assert len(low_ops) >= 10
    for n in low_ops:
        assert out_dtypes(n)[0] == LOW[precision], n.format_node()
    fp32_ops = [n for n in nodes if n.target in FP32_OPS]
    assert {n.target for n in fp32_ops} >= {aten.native_layer_norm.default, aten._log_softmax.default,
                                            aten.nll_loss_forward.default}
    for n in fp32_ops:
        assert all(d == torch.float32 for d in out_dtypes(n)), n.format_node()
        for a in n.all_input_nodes:
            assert all(d in (torch.float32, torch.int64, torch.bool) for d in out_dtypes(a)), n.format_node()


def test_each_parameter_is_cast_to_low_precision_once_for_forward_and_backward() -> None:
    x, y = batch()
    model = tiny_gpt()
    linear = {f"{m}.{p}" for m, mod in model.named_modules() if isinstance(mod, nn.Linear)
              for p, _ in mod.named_parameters(recurse=False)}
    engine = fxspeed.compile(model, 1, fxspeed.Config(precision="bf16"), example_inputs=(x, y))
    gm = engine.graph()
    sig = engine._executors[next(iter(engine._executors))].program.signature
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    casts_per_param = {}
    for spec, ph in zip(sig.inputs, placeholders):
        if spec.kind == "param":
            casts_per_param[spec.target] = sum(1 for u in ph.users if u.target == aten._to_copy.default)
    assert max(casts_per_param.values()) == 1
    fed_linear = linear & casts_per_param.keys()  # the tied head weight is fed as wte.weight
    assert len(fed_linear) >= 16 and all(casts_per_param[k] == 1 for k in fed_linear), casts_per_param
    assert casts_per_param["wte.weight"] == 1  # the tied embedding/head weight: one cast for the head


def test_modules_named_in_fp32_modules_keep_their_matmuls_in_fp32() -> None:
    x, y = batch()
    cfg = fxspeed.Config(precision="bf16", fp32_modules=("blocks.1.mlp",))
    engine = fxspeed.compile(tiny_gpt(), 1, cfg, example_inputs=(x, y))
    for n in engine.graph().graph.nodes:
        inf = n.meta.get(META_KEY)
        if n.target in LOW_OPS and inf is not None:
            want = torch.float32 if inf.module.startswith("blocks.1.mlp") else torch.bfloat16
            assert out_dtypes(n)[0] == want, (inf.module, n.format_node())


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_low_precision_training_tracks_fp32_losses(precision: str) -> None:
    losses = {}
    for p in ("fp32", precision):
        model = tiny_gpt()
        x, y = batch(rows=8)
        engine = fxspeed.compile(model, 1, fxspeed.Config(precision=p, lr=3e-3), example_inputs=(x, y))
        losses[p] = [engine.train_step(*batch(i % 4, rows=8)) for i in range(40)]
        assert engine.stats["skipped_steps"] == 0
    a, b = losses["fp32"], losses[precision]
    assert all(torch.isfinite(torch.tensor(b)))
    assert b[-1] < 0.8 * b[0]
    assert abs(sum(b[-5:]) - sum(a[-5:])) / sum(a[-5:]) < 0.02, (a[-5:], b[-5:])


class Scaler(nn.Module):
    """A model whose gradients overflow fp16 for a batch with huge values."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.l1 = nn.Linear(8, 16)
        self.l2 = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.relu(self.l1(x))).pow(2).mean()


def test_an_fp16_overflow_skips_that_step_lowers_the_scale_and_training_continues_as_if_unseen() -> None:
    g = torch.Generator().manual_seed(0)
    good = [torch.randn(4, 8, generator=g) for _ in range(4)]
    bad = torch.full((4, 8), 6e4)  # fp16 matmuls overflow to inf
    cfg = fxspeed.Config(precision="fp16", lr=1e-2, loss_scale=2.0**10)
    seen, unseen = Scaler(), Scaler()
    e1 = fxspeed.compile(seen, 1, cfg, example_inputs=(good[0],))
    e2 = fxspeed.compile(unseen, 1, copy.deepcopy(cfg), example_inputs=(good[0],))
    e1.train_step(good[0])
    e2.train_step(good[0])
    before = {k: v.clone() for k, v in seen.state_dict().items()}
    e1.train_step(bad)
    assert e1.stats["skipped_steps"] == 1 and e1.stats["loss_scale"] == 2.0**9
    for k, v in seen.state_dict().items():
        assert torch.equal(v, before[k]), k  # the overflowing step changed nothing
    for b in good[1:]:
        e1.train_step(b)
        e2.train_step(b)
    for (k, a), b in zip(seen.state_dict().items(), unseen.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=k)
    assert e1.optimizer.state_dict()["state"][0]["step"] == e2.optimizer.state_dict()["state"][0]["step"]


def test_the_loss_scale_grows_after_a_window_of_clean_steps() -> None:
    x = torch.randn(4, 8)
    engine = fxspeed.compile(Scaler(), 1, fxspeed.Config(precision="fp16", loss_scale=8.0, loss_scale_window=3),
                             example_inputs=(x,))
    for _ in range(6):
        engine.train_step(x)
    assert engine.stats["loss_scale"] == 32.0 and engine.stats["skipped_steps"] == 0


@pytest.mark.slow
def test_on_two_ranks_an_overflow_on_one_rank_skips_everywhere_and_zero3_gathers_half_the_bytes_in_bf16(
        tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "tests.workers.mixed_precision_worker", "--out", str(tmp_path)]
    proc = run_ranks(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    res = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for r in res:
        assert r["skipped"] == [0, 1, 0], r["skipped"]  # step 2 overflowed on rank 1 only
        # Bytes per gathered element (how many gathers a precision needs can differ a little:
        # shard_parameters re-gathers a bucket whose readers are far apart).
        (b32, n32), (b16, n16) = r["gather_bytes"]["fp32"], r["gather_bytes"]["bf16"]
        assert n32 > 0 and n16 > 0
        assert b32 == 4 * n32 and b16 == 2 * n16
        assert r["workspaces"]["fp32"] > 0 and r["workspaces"]["bf16"] > 0
    assert res[0]["state"].keys() == res[1]["state"].keys()
    for k in res[0]["state"]:
        assert torch.equal(res[0]["state"][k], res[1]["state"][k]), k
