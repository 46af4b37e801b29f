"""Run under `fxspeed run -n 2 -m tests.workers.buffers_worker --out DIR`: a small CNN with
BatchNorm trained on each rank's half of fixed global batches (ZeRO-0 and ZeRO-3); every rank
writes its BatchNorm buffers and parameters to DIR/zero{z}_rank{r}.pt. The test compares them
with DDP's semantics (buffers of the first rank's rows, weights of the global batch)."""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn

import fxspeed
from fxspeed.data import local_batch

STEPS = 3


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn, self.head = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn(self.conv(x))).mean((2, 3))
        return nn.functional.cross_entropy(self.head(h), y)


def build(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    # the rows differ in scale, so each half's statistics differ from the other's
    return [(torch.randn(8, 3, 6, 6, generator=g) * torch.arange(1, 9).view(8, 1, 1, 1),
             torch.randint(0, 4, (8,), generator=g)) for _ in range(STEPS)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    os.environ.setdefault("FXSPEED_BACKEND", "gloo")
    torch.set_num_threads(1)
    for zero in (0, 3):
        bs = batches()
        # ZeRO-3: each rank builds the model from its own seed (no common seed); the engine starts
        # every rank from rank 0's weights, as DDP does
        model = build(dist.get_rank() if zero == 3 and dist.is_initialized() else 0)
        engine = fxspeed.compile(model, 2, fxspeed.Config(zero=zero, optimizer="sgd", lr=0.1),
                                 example_inputs=local_batch(bs[0]))
        for b in bs:
            engine.train_step(*local_batch(b))
        torch.save(engine.state_dict(), os.path.join(a.out, f"zero{zero}_rank{dist.get_rank()}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
