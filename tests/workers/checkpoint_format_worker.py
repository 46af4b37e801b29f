"""Run under `fxspeed run -n 2 -m tests.workers.checkpoint_format_worker --ckpt DIR --out DIR`:
the canonical checkpoint format saved by two gloo ranks that hold different tensors.

1. Each rank saves `rank_state(rank)` to DIR/union: both hold the replicated "embed.weight"
   and its optimizer slots, each holds its own block (as pipeline stages do).
2. Each rank loads back only its own names with the group: out/loaded_rank{r}.pt.
3. Rank 1 holds "embed.weight" with another shape: the save to DIR/mismatch must raise
   FxspeedError on both ranks (out/mismatch_rank{r}.txt) and leave nothing at DIR/mismatch.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from fxspeed.errors import FxspeedError
from fxspeed.runtime.checkpoint import CanonicalState, load_checkpoint, save_checkpoint


def rank_state(rank: int) -> CanonicalState:
    """What rank `rank` holds; the replicated tensors are equal on both ranks."""
    shared = torch.Generator().manual_seed(0)
    own = torch.Generator().manual_seed(100 + rank)
    embed = torch.randn(16, 8, generator=shared)
    flat = torch.randn(64, generator=own)  # blocks are views of one flat buffer, as under ZeRO
    block = f"blocks.{rank}"
    model = {
        "embed.weight": embed,
        f"{block}.weight": flat[:32].view(4, 8),
        f"{block}.bias": flat[32:36],
        f"{block}.scale": torch.randn(8, generator=own).to(torch.bfloat16),
        f"{block}.counter": torch.tensor(7 + rank, dtype=torch.int64),
    }
    optimizer = {
        "embed.weight": {"exp_avg": embed * 0.1, "exp_avg_sq": embed * embed, "step": torch.tensor(5.0)},
        f"{block}.weight": {"exp_avg": torch.randn(4, 8, generator=own), "step": torch.tensor(5.0)},
    }
    extra = {"saved_by": rank, "scheduler": {"last_epoch": 5}, "rng": torch.Generator().manual_seed(rank).get_state()}
    return CanonicalState(model=model, optimizer=optimizer, extra=extra)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    group, rank = dist.group.WORLD, dist.get_rank()

    union = os.path.join(a.ckpt, "union")
    state = rank_state(rank)
    save_checkpoint(union, state, group=group, rank=rank)
    mine = list(state.model)
    torch.save(load_checkpoint(union, names=mine, group=group, rank=rank), os.path.join(a.out, f"loaded_rank{rank}.pt"))

    bad = rank_state(rank)
    if rank == 1:
        bad.model["embed.weight"] = torch.zeros(16, 9)
    try:
        save_checkpoint(os.path.join(a.ckpt, "mismatch"), bad, group=group, rank=rank)
        msg = "no error"
    except FxspeedError as e:
        msg = f"FxspeedError: {e}"
    with open(os.path.join(a.out, f"mismatch_rank{rank}.txt"), "w") as f:
        f.write(msg)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
