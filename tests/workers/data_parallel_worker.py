"""Run under torch.distributed.run: trains models with fxspeed on this rank's slice of a fixed
global batch for each requested ZeRO stage and writes losses and full parameters to --out.

The test that launches it compares against one process on the global batch.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

import fxspeed
from fxspeed.data import local_batch
from tests.workers.common import build_model, global_batches


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="gpt")
    ap.add_argument("--zero", default="0,1,2,3")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", required=True)
    ap.add_argument("--grad-clip", type=float, default=None)
    ap.add_argument("--bucket-mb", type=float, default=0.05)
    ap.add_argument("--optimizers", default="adamw")
    ap.add_argument("--runs", default="", help="model:zero:optimizer,... instead of the product of the lists above")
    a = ap.parse_args()
    os.environ.setdefault("FXSPEED_BACKEND", "gloo")
    torch.set_num_threads(1)
    runs = [(n, z, o) for n in a.models.split(",") for z in map(int, a.zero.split(",")) for o in a.optimizers.split(",")]
    if a.runs:
        runs = [(n, int(z), o) for n, z, o in (r.split(":") for r in a.runs.split(","))]
    for name, zero, opt in runs:
            model = build_model(name)
            batches = global_batches(name, a.steps)
            cfg = fxspeed.Config(zero=zero, lr=1e-2, grad_clip=a.grad_clip, bucket_mb=a.bucket_mb, optimizer=opt,
                                 momentum=0.9 if opt == "sgd" else 0.0)
            world = int(os.environ["WORLD_SIZE"])
            first = local_batch(batches[0])
            engine = fxspeed.compile(model, world, cfg, example_inputs=first)
            losses = []
            for b in batches:
                lb = local_batch(b)
                losses.append(engine.train_step(**lb) if isinstance(lb, dict) else engine.train_step(*lb))
            state = engine.state_dict()
            if dist.get_rank() == 0:
                torch.save({"losses": losses, "state": state}, os.path.join(a.out, f"{name}_zero{zero}_{opt}.pt"))
            dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
