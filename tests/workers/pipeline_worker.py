"""Run under torch.distributed.run with N = pipeline ranks: trains the tiny GPT (tied wte/head)
with fxspeed pipeline parallelism for each requested (schedule, micro-batches) and writes, per
rank, the losses and the parameters the rank holds to --out/{schedule}_m{M}_rank{r}.pt.

Every rank passes the same full batch. The test merges the ranks' parameters and compares
with one eager process on the whole batch.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

import fxspeed
from tests.workers.common import build_model, global_batches


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--schedules", default="gpipe,1f1b")
    ap.add_argument("--microbatches", default="")  # comma list; default P and 2P
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--grad-clip", type=float, default=None)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    os.environ.setdefault("FXSPEED_BACKEND", "gloo")
    torch.set_num_threads(1)
    world = int(os.environ["WORLD_SIZE"])
    mbs = [int(m) for m in a.microbatches.split(",")] if a.microbatches else [world, 2 * world]
    batches = global_batches("gpt", a.steps)
    for sched in a.schedules.split(","):
        for M in mbs:
            model = build_model("gpt")
            cfg = fxspeed.Config(pipeline=world, microbatches=M, schedule=sched, lr=1e-2, optimizer="adamw",
                                 grad_clip=a.grad_clip)
            engine = fxspeed.compile(model, world, cfg, example_inputs=batches[0])
            losses = [engine.train_step(*b) for b in batches]
            state = {k: v.clone() for k, v in engine.state_dict().items()}
            torch.save({"losses": losses, "state": state, "stages": engine.stages,
                        "describe": engine.describe() if dist.get_rank() == 0 else None},
                       os.path.join(a.out, f"{sched}_m{M}_rank{dist.get_rank()}.pt"))
            dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
