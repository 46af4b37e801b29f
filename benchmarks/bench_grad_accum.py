"""Gradient accumulation under data parallelism: one reduction per step against one per slice.

    python -m fxspeed run -n 2 benchmarks/bench_grad_accum.py --out ga.json                 # GPT small, k=4
    python -m fxspeed run -n 2 benchmarks/bench_grad_accum.py --preset 100m --accum 2 --out ga.json

Under Config(grad_accum=k) with ZeRO-0/1 the step's first k-1 slices sum their gradients locally
and the last slice's program reduces the sum (DDP's no_sync); before, every slice all-reduced its
own gradients. In one launch, side by side (the rows' steps alternate, so load that changes over
seconds hits them alike), on `--nproc` gloo ranks with one thread each:

    fx{z}        fxspeed ZeRO-z, grad_accum=k: one reduction per step (the default now)
    fx{z}-every  the same engine build with the engine's local accumulation turned off: k reductions
    ddp          torch DDP, the first k-1 slices under no_sync(): DDP's own recipe

Reported: the median step time of each row (slowest rank), and the ratio to fx{z}-every and to
DDP. All rows train the same GPT from the same weights on the same batches; the fxspeed rows'
losses (the global batch's) agree; DDP's is rank 0's own, so it differs slightly.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import statistics
import time

import torch
import torch.distributed as dist


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--accum", type=int, default=4, help="grad_accum slices per step")
    ap.add_argument("--rows", type=int, default=1, help="rows per slice and rank")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--zero", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    import fxspeed
    from fxspeed.models import GPT, GPTConfig

    torch.manual_seed(0)
    base = GPT(GPTConfig.preset(a.preset))
    cfg = base.config
    g = torch.Generator().manual_seed(1 + rank)
    rows = a.rows * a.accum
    x = torch.randint(0, cfg.vocab_size, (rows, a.seq), generator=g)
    y = torch.randint(0, cfg.vocab_size, (rows, a.seq), generator=g)

    steps: dict[str, callable] = {}
    for z in a.zero:
        for every in (False, True):
            engine = fxspeed.compile(copy.deepcopy(base), world, fxspeed.Config(zero=z, grad_accum=a.accum, lr=1e-4),
                                     example_inputs=(x, y))
            if every:
                engine._accumulates_locally = lambda: False  # the previous behaviour: reduce every slice
            steps[f"fx{z}" + ("-every" if every else "")] = lambda e=engine: e.train_step(x, y)

    ddp = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4, fused=True)

    def ddp_step() -> float:
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for i, (xs, ys) in enumerate(zip(x.chunk(a.accum), y.chunk(a.accum))):
            ctx = ddp.no_sync() if i < a.accum - 1 else contextlib.nullcontext()
            with ctx:
                loss = ddp(xs, ys) / a.accum
                loss.backward()
            total += loss.item()
        opt.step()
        return total

    steps["ddp"] = ddp_step
    times: dict[str, list[float]] = {n: [] for n in steps}
    losses: dict[str, list[float]] = {n: [] for n in steps}
    for s in range(a.steps + 1):
        order = list(steps) if s % 2 == 0 else list(reversed(steps))
        for name in order:
            dist.barrier()
            t0 = time.perf_counter()
            loss = steps[name]()
            t = torch.tensor(time.perf_counter() - t0)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            if s > 0:  # the first step of each row compiles / warms up
                times[name].append(float(t))
            losses[name].append(float(loss))
    med = {n: statistics.median(v) for n, v in times.items()}
    if rank == 0:
        n_params = sum(p.numel() for p in base.parameters())
        print(f"GPT {a.preset} ({n_params / 1e6:.1f}M params), {world} gloo ranks x 1 thread, grad_accum={a.accum} "
              f"slices of {a.rows}x{a.seq} tokens per rank; median of {a.steps} steps after 1 warm-up, rows alternating")
        print(f"{'row':<12} {'step s':>8} {'vs every':>9} {'vs DDP':>8}  first losses")
        for name, t in med.items():
            every = med.get(name + "-every")
            print(f"{name:<12} {t:8.3f} {(f'{t / every:.3f}x') if every else '':>9} {t / med['ddp']:7.3f}x  "
                  f"{' '.join(f'{v:.4f}' for v in losses[name][:3])}")
        with open(a.out, "w") as f:
            json.dump({"args": vars(a), "median_step_s": med, "losses": losses, "times": times}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("FXSPEED_BACKEND", "gloo")
    main()
