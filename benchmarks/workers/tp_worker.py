"""Run under torch.distributed.run (gloo, CPU): train one tensor-parallel (or one-process) setup of
the same GPT and record step times, losses and peak RSS (see benchmarks/bench_tensor_parallel.py).

Modes:
    eager     plain PyTorch on one process (the reference for memory and loss)
    fx        fxspeed.compile on one process
    dtensor   torch DTensor `parallelize_module` with the Megatron plan on every block (q/k/v and
              fc ColwiseParallel, both projections RowwiseParallel; embedding and head whole)
    fxtp      fxspeed.compile(..., Config(tensor=world)): the layout the planner's solver picks
    fxsp      the same with Config(sequence_parallel=True): norms and residuals split by tokens
    fxpp      Config(tensor=2, pipeline=world/2, microbatches=4): TP x PP (fxppsp: with sequence parallelism)

The model is fxspeed's GPT with attention's fused QKV split into q, k and v Linears (same math):
DTensor's ColwiseParallel on a fused QKV would hand each rank [all of q, half of k] and the
model's split would be wrong; torchtitan's models keep them separate for the same reason.
Every mode sees the same global batch on every rank (tensor parallelism has no data split), torch
Adam (fused where the tensors allow), lr 1e-4, one intra-op thread per rank. Writes
{mode}_rank{r}.json into --out.
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from benchmarks.workers.dp_worker import reset_peak, status_kb
from fxspeed.models import GPT, GPTConfig

LR = 1e-4


class SplitQKVAttention(nn.Module):
    def __init__(self, width: int, heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.head_dim, self.dropout = width // heads, dropout
        self.q, self.k, self.v = (nn.Linear(width, width) for _ in range(3))
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        # -1 heads: under DTensor each rank's q/k/v hold heads / T heads
        q, k, v = (m(x).view(B, T, -1, self.head_dim).transpose(1, 2) for m in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))


def build(a: argparse.Namespace) -> GPT:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=a.vocab, block_size=a.seq, n_layer=a.layers, n_head=a.width // 64,
                          n_embd=a.width, dropout=a.dropout))
    for block in model.blocks:
        block.attn = SplitQKVAttention(a.width, a.width // 64, a.dropout)
    model.apply(model._init_weights)
    return model


def setup(mode: str, model: GPT, example: tuple, world: int):  # noqa: ANN201
    """(step(x, y) -> loss, handles to keep alive)."""
    if mode in ("fx", "fxtp", "fxsp", "fxpp", "fxppsp"):
        import math

        import fxspeed

        if mode.startswith("fxpp"):  # TP=2 x PP=world/2, micro-batches of the batch's rows (at most 4)
            cfg = fxspeed.Config(optimizer="adam", lr=LR, tensor=2, pipeline=world // 2,
                                 microbatches=math.gcd(example[0].shape[0], 4), sequence_parallel=mode == "fxppsp")
        else:
            cfg = fxspeed.Config(optimizer="adam", lr=LR, tensor=1 if mode == "fx" else world,
                                 sequence_parallel=mode == "fxsp")
        engine = fxspeed.compile(model, world, cfg, example_inputs=example)
        return engine.train_step, (engine,)
    if mode == "dtensor":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_device_mesh("cpu", (world,))
        plan = {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
                "attn.proj": RowwiseParallel(), "mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel()}
        for block in model.blocks:
            parallelize_module(block, mesh, plan)
    # The fused kernel refuses a mix of DTensor and plain tensors in one call: one optimizer for
    # the sharded parameters, one for the replicated ones (embedding, norms, head).
    from torch.distributed.tensor import DTensor

    params = list(model.parameters())
    groups = [[p for p in params if isinstance(p, DTensor)], [p for p in params if not isinstance(p, DTensor)]]
    opts = [torch.optim.Adam(g, lr=LR, fused=True) for g in groups if g]

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        loss = model(x, y)
        loss.backward()
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
        return float(loss)

    return step, (model, opts)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=("eager", "fx", "dtensor", "fxtp", "fxsp", "fxpp", "fxppsp"), required=True)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--dropout", type=float, default=0.0)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build(a)
    n_params = sum(p.numel() for p in model.parameters())
    g = torch.Generator().manual_seed(0)  # the same global batch on every rank
    batches = [(torch.randint(0, a.vocab, (a.batch, a.seq), generator=g),
                torch.randint(0, a.vocab, (a.batch, a.seq), generator=g)) for _ in range(a.warmup + a.steps)]
    gc.collect()
    dist.barrier()
    base = status_kb("VmRSS")
    reset_peak()
    t0 = time.perf_counter()
    step, keep = setup(a.mode, model, batches[0], world)
    setup_s = time.perf_counter() - t0
    times, losses = [], []
    for x, y in batches:
        t = time.perf_counter()
        losses.append(step(x, y))
        dt = torch.tensor(time.perf_counter() - t, dtype=torch.float64)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)  # the slowest rank's step
        times.append(float(dt))
    record = {"mode": a.mode, "rank": rank, "world": world, "n_params": n_params, "setup_s": setup_s,
              "step_times_s": times[a.warmup:], "losses": losses, "baseline_rss_bytes": base * 1024,
              "peak_rss_bytes": status_kb("VmHWM") * 1024, "peak_growth_bytes": (status_kb("VmHWM") - base) * 1024}
    with open(f"{a.out}/{a.mode}_rank{rank}.json", "w") as f:
        json.dump(record, f)
    del step, keep
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
