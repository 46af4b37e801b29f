"""Two ranks: fp16 ZeRO-2 with an overflow on rank 1 only; bytes all-gathered per step by
ZeRO-3 in fp32 vs bf16 (summed over the collective nodes of the compiled graph)."""

from __future__ import annotations

import argparse
import logging
import os

import torch
import torch.distributed as dist

import fxspeed
from fxspeed.passes.parallel.shard_parameters import GATHER_KEY
from tests.test_mixed_precision import Scaler, batch, tiny_gpt

def gathered(engine: fxspeed.Engine) -> tuple[int, int]:
    """(bytes, elements) of the full buckets ZeRO-3 gathers per step (an all-gather, or on gloo
    an all-reduce of the zero-padded shard: shard_parameters marks the collective either way)."""
    nbytes = numel = 0
    for n in engine.graph().graph.nodes:
        if GATHER_KEY in n.meta:
            v = n.meta["val"]
            nbytes += v.numel() * v.element_size()
            numel += v.numel()
    return nbytes, numel


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(1)
    world = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])
    g = torch.Generator().manual_seed(rank)
    good = [torch.randn(4, 8, generator=g) for _ in range(3)]
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("fxspeed").addHandler(handler)
    model = Scaler()
    engine = fxspeed.compile(model, world, fxspeed.Config(precision="fp16", zero=2, loss_scale=2.0**10),
                             example_inputs=(good[0],))
    skipped = []
    for step, b in enumerate(good):
        if step == 1 and rank == 1:
            b = torch.full((4, 8), 6e4)
        before = engine.stats["skipped_steps"]
        engine.train_step(b)
        skipped.append(engine.stats["skipped_steps"] - before)
    state = engine.state_dict()
    overflow_lines = sum("overflowed in fp16" in m for m in said)
    volume, workspaces = {}, {}
    for precision in ("fp32", "bf16"):
        x, y = batch()
        e = fxspeed.compile(tiny_gpt(), world, fxspeed.Config(zero=3, precision=precision, bucket_mb=0.01),
                            example_inputs=(x, y))
        e.train_step(x, y)
        volume[precision] = gathered(e)
        # Gathered and flattened buckets share a few workspaces (passes/reuse_buffers).
        workspaces[precision] = sum(n.target is torch.ops.aten.empty.memory_format for n in e.graph().graph.nodes)
    torch.save({"skipped": skipped, "overflow_lines": overflow_lines, "state": state, "gather_bytes": volume, "workspaces": workspaces}, os.path.join(a.out, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
