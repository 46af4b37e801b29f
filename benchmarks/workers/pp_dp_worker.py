"""One launch of bench_pipeline_dp.py: fxspeed pipeline x data parallel, step times per rank.

Every rank: GPT (--preset, seed 0), Config(pipeline=2, microbatches=M, zero=Z, adamw), its
replica's half of the global batch; --warmup steps, then --steps timed steps, each after a
barrier. Rank 0 writes {"step_s": [max over ranks per step], "losses": [...]} to --out.
Uses only the public API, so the same file runs against any checkout.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist

import fxspeed
from fxspeed.models import GPT, GPTConfig


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="small")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--zero", type=int, default=0)
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    os.environ.setdefault("FXSPEED_BACKEND", "gloo")
    torch.set_num_threads(1)
    world = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])
    P, D = 2, world // 2
    torch.manual_seed(0)
    cfg = GPTConfig.preset(a.preset)
    model = GPT(cfg)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, cfg.vocab_size, (a.batch, a.seq), generator=g)
    y = torch.randint(0, cfg.vocab_size, (a.batch, a.seq), generator=g)
    rows = a.batch // D
    mine = (x[rank // P * rows:(rank // P + 1) * rows], y[rank // P * rows:(rank // P + 1) * rows])
    engine = fxspeed.compile(model, world, fxspeed.Config(pipeline=P, microbatches=a.microbatches, zero=a.zero,
                                                          schedule=a.schedule, optimizer="adamw", lr=3e-4),
                             example_inputs=mine)
    times, losses = [], []
    for i in range(a.warmup + a.steps):
        dist.barrier()
        t0 = time.perf_counter()
        losses.append(engine.train_step(*mine))
        dt = torch.tensor(time.perf_counter() - t0)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        if i >= a.warmup:
            times.append(float(dt))
    if rank == 0:
        with open(a.out, "w") as f:
            json.dump({"step_s": times, "losses": losses}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
