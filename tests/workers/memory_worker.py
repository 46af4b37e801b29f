"""Run under torch.distributed.run: peak RSS growth of a training step on this rank.

Each rank builds the model, reads its resident set size (the kernel's VmRSS), resets the
kernel's peak counter (/proc/self/clear_refs), then compiles and trains; the peak (VmHWM)
minus the baseline is the memory the training run added on top of the model, as the OS
sees it. Writes one JSON line per rank to --out.

MALLOC_MMAP_THRESHOLD_ should be set by the launcher so freed tensors go back to the OS
(otherwise glibc keeps them in its heap and RSS stays at old peaks).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import json
import os

import torch
import torch.distributed as dist

import fxspeed
from fxspeed.models import GPT, GPTConfig


def status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def main() -> None:
    ap = argparse.ArgumentParser()
    # ZeRO stages to run, one after another: "2" (fp32), "bf16:2" (that precision), "tp2:0" (that
    # tensor-parallel degree; "tp2:bf16:0" both), "end:2" (the optimizer steps after the program,
    # not per gradient bucket inside backward: every gradient held to the end, as the ZeRO paper counts)
    ap.add_argument("--zero", default="0,1,2,3")
    ap.add_argument("--preset", default="100m")
    ap.add_argument("--layers", type=int, default=None, help="blocks (default: the preset's)")
    ap.add_argument("--width", type=int, default=None, help="n_embd (default: the preset's)")
    ap.add_argument("--heads", type=int, default=None, help="n_head (default: the preset's)")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--tensor", type=int, default=1)  # tensor-parallel degree of items without a tpN: prefix
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    items = [parse(item, a.tensor) for item in a.zero.split(",")]
    # Warm up once per tensor-parallel degree so that code loaded on first use (tracing
    # machinery, collectives) is not charged to whichever stage happens to run first.
    # And once per precision: the first bf16 matmul of a process adds about 5 MB of RSS that stays
    # (kernel code and caches loaded on first use, no tensor), which had gone to the first bf16
    # item (bf16 ZeRO-1, 19M GPT: 7 MB of its 248).
    for tensor, precision in sorted({(t, p) for _, p, t, _ in items}):
        torch.manual_seed(0)  # the same weights on every rank (else the engine warns that they differ)
        tiny = GPT(GPTConfig.preset("tiny"))
        x = torch.randint(0, 256, (a.batch, 16), generator=torch.Generator().manual_seed(0))  # same on every rank
        warm = fxspeed.Config(zero=3 if tensor == 1 else 0, optimizer="adam", tensor=tensor, precision=precision)
        fxspeed.compile(tiny, world, warm, example_inputs=(x, x)).train_step(x, x)
        del tiny
        gc.collect()
    # One model built per process, copied for each item: the same weights every time (seed 0), and
    # a copy costs half of GPT's random init of >= 100M parameters (about 1 of 2 CPU-seconds per
    # item and rank). It sits in the baseline RSS of every item, which the growth subtracts.
    template = build(a)
    for zero, precision, tensor, end in items:
        run(zero, precision, tensor, a, world, end, template)
        gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


def parse(item: str, tensor: int) -> tuple[int, str, int, bool]:
    """'bf16:2' -> (2, 'bf16', tensor, False); 'tp2:0' -> (0, 'fp32', 2, False); 'end:1' -> (1, 'fp32', tensor, True)."""
    *prefix, zero = item.split(":")
    precision, end = "fp32", False
    for p in prefix:
        if p.startswith("tp"):
            tensor = int(p[2:])
        elif p == "end":
            end = True
        else:
            precision = p
    return int(zero), precision, tensor, end


def build(a: argparse.Namespace) -> GPT:
    torch.manual_seed(0)
    cfg = GPTConfig.preset(a.preset)
    cfg = dataclasses.replace(cfg, n_layer=a.layers or cfg.n_layer, n_embd=a.width or cfg.n_embd,
                              n_head=a.heads or cfg.n_head)
    return GPT(cfg)


def run(zero: int, precision: str, tensor: int, a: argparse.Namespace, world: int, end: bool = False,
        template: GPT | None = None) -> None:
    model = copy.deepcopy(template) if template is not None else build(a)
    torch.manual_seed(0)
    # the same batch on every rank: tensor-parallel ranks must pass the same one (the engine checks)
    x = torch.randint(0, model.config.vocab_size, (a.batch, a.seq), generator=torch.Generator().manual_seed(0))
    if dist.is_initialized():
        dist.barrier()
    base = status_kb("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    off = ("step_in_backward", "step_buckets_in_backward") if end else ()
    engine = fxspeed.compile(model, world, fxspeed.Config(zero=zero, optimizer="adam", precision=precision, tensor=tensor,
                                                          disable_passes=off), example_inputs=(x, x))
    for _ in range(a.steps):
        engine.train_step(x, x)
    peak = status_kb("VmHWM")
    rank = dist.get_rank() if dist.is_initialized() else 0
    rec = {"rank": rank, "world": world, "zero": zero, "precision": precision, "tensor": tensor, "end": end,
           "baseline_bytes": base * 1024,
           "growth_bytes": (peak - base) * 1024, "plan_peak_bytes": engine.plan.peak_memory(rank),
           "param_bytes": 4 * engine.plan.n_params}
    with open(os.path.join(a.out, f"mem_w{world}_tp{tensor}_{precision}_zero{zero}{'_end' if end else ''}_rank{rank}.json"),
              "w") as f:
        json.dump(rec, f)
    del engine, model

if __name__ == "__main__":
    main()
