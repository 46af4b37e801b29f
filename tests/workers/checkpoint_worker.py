"""Run under `fxspeed run -n 2 -m tests.workers.checkpoint_worker`: checkpoint save/resume per ZeRO stage.

--phase save: for each stage, compile the tiny GPT, train 3 steps, engine.save(ckpt/zero{z}), train
    2 more steps; rank 0 writes the 2 losses, the final full state_dict and the state_dict taken
    right after compile (untrained) to out/save_zero{z}.pt.
--phase load: in a fresh process group, build the model from another seed (so nothing matches
    unless load() restores it), compile, engine.load(ckpt/zero{z}), train the same 2 steps;
    rank 0 writes out/load_zero{z}.pt. Loading a checkpoint of another ZeRO stage must fail;
    with --mismatch-zero S, also load the checkpoint of stage --mismatch-from (default: the last
    stage run) into an engine of stage S: the message of each rank (ConfigError, or "no error")
    goes to out/mismatch_rank{r}.txt.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

import fxspeed
from fxspeed.data import local_batch
from fxspeed.errors import ConfigError
from tests.workers.common import build_model, global_batches

SAVE_AT, MORE = 3, 2


def config(zero: int) -> fxspeed.Config:
    return fxspeed.Config(zero=zero, lr=1e-2, grad_clip=0.5, bucket_mb=0.05, optimizer="adamw")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--phase", choices=("save", "load"), required=True)
    ap.add_argument("--zero", default="0,1,2,3")
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--mismatch-zero", type=int, default=None)
    ap.add_argument("--mismatch-from", type=int, default=None, help="the stage whose checkpoint --mismatch-zero loads")
    a = ap.parse_args()
    os.environ.setdefault("FXSPEED_BACKEND", "gloo")
    torch.set_num_threads(1)
    world = int(os.environ["WORLD_SIZE"])
    batches = global_batches("gpt", SAVE_AT + MORE)
    for zero in map(int, a.zero.split(",")):
        model = build_model("gpt")
        if a.phase == "load":
            torch.manual_seed(1234)  # other initial weights: only load() can make the runs agree
            for p in model.parameters():
                torch.nn.init.normal_(p.data)
        engine = fxspeed.compile(model, world, config(zero), example_inputs=local_batch(batches[0]))
        record: dict = {}
        ckpt = os.path.join(a.ckpt, f"zero{zero}")
        if a.phase == "save":
            # state_dict() tensors alias the live weights under ZeRO 0-2 (as nn.Module's do): snapshot
            record["initial_state"] = {k: v.clone() for k, v in engine.state_dict().items()}
            for b in batches[:SAVE_AT]:
                engine.train_step(*local_batch(b))
            engine.save(ckpt)
        else:
            engine.load(ckpt)
        record["losses"] = [engine.train_step(*local_batch(b)) for b in batches[SAVE_AT:]]
        record["state"] = engine.state_dict()  # collective under ZeRO-3: every rank calls it
        if dist.get_rank() == 0:
            torch.save(record, os.path.join(a.out, f"{a.phase}_zero{zero}.pt"))
        dist.barrier()
    if a.phase == "load" and a.mismatch_zero is not None:
        if a.mismatch_from is not None:
            ckpt = os.path.join(a.ckpt, f"zero{a.mismatch_from}")
        # A checkpoint of one ZeRO stage loaded into an engine of another: a clear error on every rank.
        engine = fxspeed.compile(build_model("gpt"), world, config(a.mismatch_zero),
                                 example_inputs=local_batch(batches[0]))
        try:
            engine.load(ckpt)
            msg = "no error"
        except ConfigError as e:
            msg = f"ConfigError: {e}"
        with open(os.path.join(a.out, f"mismatch_rank{dist.get_rank()}.txt"), "w") as f:
            f.write(msg)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
