"""Run under `fxspeed run -n N -m tests.workers.reshard_worker`: a checkpoint written under one
mesh, resumed under another.

--phase save (4 ranks): ZeRO-3 data parallel, 3 steps, engine.save(--ckpt), then 2 more steps
    uninterrupted; rank 0 writes those 2 losses to --out/straight.pt.
--phase load (N ranks, --pipeline P --zero Z): build the model from another seed (only load()
    can make the runs agree), compile for P x (N / P), engine.load(--ckpt), train the same 2
    steps on the same global batches; rank 0 writes the losses to --out/resumed_<tag>.pt.
--phase save,load: both in turn in this launch (a 4-rank launch costs more than either phase),
    the saving engine deleted before the loading one is built: only the files on disk carry
    the run over. (The test also loads the checkpoint in its own, fresh, process.)
"""

from __future__ import annotations

import argparse
import gc
import os

import torch
import torch.distributed as dist

import fxspeed
from fxspeed.data import local_batch
from tests.workers.common import build_model, global_batches

SAVE_AT, MORE = 3, 2


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--phase", choices=("save", "load", "save,load"), required=True)
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--pipeline", type=int, default=1, help="the load phase's pipeline degree")
    ap.add_argument("--zero", type=int, default=3, help="the load phase's ZeRO stage (save: always 3)")
    ap.add_argument("--tag", default="")
    a = ap.parse_args()
    os.environ.setdefault("FXSPEED_BACKEND", "gloo")
    torch.set_num_threads(1)
    for phase in a.phase.split(","):
        if phase == "save":
            run(a, "save", pipeline=1, zero=3)
        else:
            run(a, "load", pipeline=a.pipeline, zero=a.zero)
        gc.collect()
    dist.destroy_process_group()


def run(a: argparse.Namespace, phase: str, pipeline: int, zero: int) -> None:
    world = int(os.environ["WORLD_SIZE"])
    batches = global_batches("gpt", SAVE_AT + MORE)
    P = pipeline
    cfg = fxspeed.Config(zero=zero, pipeline=P, microbatches=2 if P > 1 else 1, lr=1e-2, grad_clip=0.5,
                         optimizer="adamw", bucket_mb=0.05)
    model = build_model("gpt")
    if phase == "load":
        torch.manual_seed(1234)
        for p in model.parameters():
            torch.nn.init.normal_(p.data)
    rank = int(os.environ["RANK"])
    replica, replicas = rank // P, world // P
    mine = [local_batch(b, replica, replicas) for b in batches]
    engine = fxspeed.compile(model, world, cfg, example_inputs=mine[0])
    if phase == "save":
        for b in mine[:SAVE_AT]:
            engine.train_step(*b)
        engine.save(a.ckpt)
        losses = [engine.train_step(*b) for b in mine[SAVE_AT:]]
        name = "straight.pt"
    else:
        engine.load(a.ckpt)
        losses = [engine.train_step(*b) for b in mine[SAVE_AT:]]
        name = f"resumed_{a.tag}.pt"
    state = {k: v.clone() for k, v in engine.state_dict().items()}
    if dist.get_rank() == 0:
        torch.save({"losses": losses, "state": state}, os.path.join(a.out, name))
    dist.barrier()


if __name__ == "__main__":
    main()
