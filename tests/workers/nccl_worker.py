"""One CUDA rank under NCCL (world size 1): fxspeed.compile(..., devices=1) after the script
initialized the process group itself, for several ZeRO stages and precisions, 3 steps each.

    MASTER_ADDR=127.0.0.1 MASTER_PORT=<free> RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 \
        python -m tests.workers.nccl_worker

Prints one line `LOSSES {"zero1-fp32": [...], ...}`; tests/test_cuda.py compares it with the
same runs in a process without a process group. The model and batch come from `cuda_gpt`.
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

import fxspeed
from fxspeed.models import GPT, GPTConfig

# (zero stage, precision) runs; the name is what the test reads
RUNS = {"zero1-fp32": (1, "fp32"), "zero3-fp32": (3, "fp32"), "zero3-bf16": (3, "bf16")}
STEPS = 3


def cuda_gpt(device: torch.device) -> tuple[torch.nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """A small fxspeed GPT (2 blocks, width 128, vocab 512) and one 4x128 batch, both seeded."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=512, block_size=128, n_layer=2, n_head=4, n_embd=128)).to(device)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 512, (4, 128), generator=g)
    y = torch.randint(0, 512, (4, 128), generator=g)
    return model, (x.to(device), y.to(device))


def train(device: torch.device, zero: int, precision: str) -> list[float]:
    model, batch = cuda_gpt(device)
    engine = fxspeed.compile(model, 1, fxspeed.Config(zero=zero, precision=precision), example_inputs=batch)
    return [engine.train_step(*batch) for _ in range(STEPS)]


def main() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl")
    assert dist.get_backend() == "nccl" and dist.get_world_size() == 1
    device = torch.device("cuda", torch.cuda.current_device())
    try:
        losses = {name: train(device, zero, precision) for name, (zero, precision) in RUNS.items()}
    finally:
        dist.destroy_process_group()
    print("LOSSES " + json.dumps(losses), flush=True)


if __name__ == "__main__":
    main()
