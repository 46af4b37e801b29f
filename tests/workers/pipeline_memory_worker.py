"""Run under torch.distributed.run: peak RSS of pipeline-parallel training on this rank.

Uses the public API only (fxspeed.compile, engine.train_step). Each rank warms up (a tiny
pipeline compiles and steps once, so code loaded on first use and the process group are in
the baseline), reads its resident set size (VmRSS), resets the kernel's peak counter
(/proc/self/clear_refs), then builds the model, compiles and trains; the peak (VmHWM) minus
the baseline is what building and training the model cost this rank, as the OS sees it. The
model is built after the baseline, so the peak counts the weights the rank keeps (the
engine frees the other stages' weights, and the full model before that is smaller than the
training peak of a stage with Adam). Writes one JSON file per rank to --out.

MALLOC_MMAP_THRESHOLD_ should be set by the launcher so freed tensors go back to the OS.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os

import torch
import torch.distributed as dist

import fxspeed
from fxspeed.models import GPT, GPTConfig
from tests.workers.memory_worker import status_kb


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := the current VmRSS


def model_config(a: argparse.Namespace) -> GPTConfig:
    return GPTConfig(vocab_size=a.vocab, block_size=a.seq, n_layer=a.layers, n_head=a.heads, n_embd=a.width)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    os.environ.setdefault("FXSPEED_BACKEND", "gloo")
    torch.set_num_threads(1)
    world = int(os.environ["WORLD_SIZE"])
    cfg = fxspeed.Config(pipeline=world, microbatches=a.microbatches, schedule=a.schedule, optimizer="adamw")

    tiny = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32))
    x = torch.randint(0, 64, (a.microbatches, 16), generator=torch.Generator().manual_seed(0))  # same on every rank
    fxspeed.compile(tiny, world, cfg, example_inputs=(x, x)).train_step(x, x)
    del tiny
    gc.collect()
    dist.barrier()

    base = status_kb("VmRSS")
    reset_peak()
    torch.manual_seed(0)
    model = GPT(model_config(a))
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, a.vocab, (a.batch, a.seq), generator=g)
    y = torch.randint(0, a.vocab, (a.batch, a.seq), generator=g)
    built = status_kb("VmRSS")
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # before other stages' are freed
    engine = fxspeed.compile(model, world, cfg, example_inputs=(x, y))
    compiled = status_kb("VmRSS")
    steps = []
    for _ in range(a.steps):
        engine.train_step(x, y)
        steps.append((status_kb("VmRSS"), status_kb("VmHWM")))
    peak = status_kb("VmHWM")
    rank = dist.get_rank()
    plan = getattr(engine, "plan", None)
    kb = lambda v: (v - base) * 1024  # noqa: E731 - bytes above the baseline
    rec = {"rank": rank, "world": world, "model": dataclasses.asdict(model_config(a)), "batch": [a.batch, a.seq],
           "microbatches": a.microbatches, "schedule": a.schedule, "baseline_bytes": base * 1024,
           "peak_bytes": kb(peak), "built_bytes": kb(built), "compiled_bytes": kb(compiled),
           # after each step: RSS (weights, gradient buffers, optimizer states: the steady state) and peak so far
           "steps": [{"rss": kb(r), "hwm": kb(h)} for r, h in steps], "model_param_bytes": model_bytes,
           "engine_plan": plan.memory(rank) if plan is not None else None}
    with open(os.path.join(a.out, f"pipe_mem_rank{rank}.json"), "w") as f:
        json.dump(rec, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
