"""Run under `fxspeed run -n 2 -m tests.workers.reliability_worker --case CASE`: failure modes.

    raise      rank 1 raises after compile and one step; rank 0 keeps training (its next
               collective can never complete): the launcher must stop it and name rank 1
    exit       as raise, but rank 1 dies abruptly with os._exit(13)
    model      rank 1 builds a different model      -> ConfigError at compile on every rank
    config     rank 1 passes a different Config      -> ConfigError at compile on every rank
    indivisible  a global batch of 5 rows on 2 ranks -> ConfigError from local_batch
    shapes     rank 1's local batch has another shape -> ConfigError at compile on every rank

Expected errors are written to --out/rank{r}.txt as "ConfigError: message" and the worker exits 0.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

import fxspeed
from fxspeed.data import local_batch
from fxspeed.errors import ConfigError
from fxspeed.models import GPT, GPTConfig
from tests.workers.common import build_model, global_batches


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", required=True,
                    choices=("raise", "exit", "model", "config", "indivisible", "shapes"))
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    os.environ.setdefault("FXSPEED_BACKEND", "gloo")
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    batches = global_batches("gpt", 50)
    model = build_model("gpt")
    cfg = fxspeed.Config(zero=3, lr=1e-2, bucket_mb=0.05)
    example = local_batch(batches[0])

    if a.case in ("raise", "exit"):
        engine = fxspeed.compile(model, world, cfg, example_inputs=example)
        engine.train_step(*example)
        if rank == 1:
            if a.case == "exit":
                os._exit(13)
            raise RuntimeError("rank 1 fails on purpose after compile")
        t0 = time.time()
        for b in batches[1:]:  # blocks in the step's first collective: rank 1 is gone
            engine.train_step(*local_batch(b))
        print(f"rank {rank}: trained {len(batches) - 1} steps without rank 1 in {time.time() - t0:.1f} s", flush=True)
        raise SystemExit(0)

    try:
        if a.case == "model" and rank == 1:
            model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=3, n_head=2, n_embd=32))
        if a.case == "config" and rank == 1:
            cfg = fxspeed.Config(zero=3, lr=3e-2, bucket_mb=0.05)
        if a.case == "indivisible":
            x = torch.randint(0, 64, (5, 16))
            example = local_batch((x, x))
        if a.case == "shapes" and rank == 1:
            example = tuple(t[:, :8] for t in example)  # a shorter sequence on rank 1 only
        engine = fxspeed.compile(model, world, cfg, example_inputs=example)
        engine.train_step(*example)
        msg = "no error"
    except ConfigError as e:
        msg = f"ConfigError: {e}"
    with open(os.path.join(a.out, f"rank{rank}.txt"), "w") as f:
        f.write(msg)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
