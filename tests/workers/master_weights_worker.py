"""Ranks of tests/test_master_weights.py: ZeRO-1/2/3 under bf16/fp16 with master weights (the
ZeRO paper's layout) against ZeRO-0 (fp32 weights cast per step, the layout before it) and fp32
training on the same global batches; a checkpoint of one layout resumed under another."""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

import fxspeed
from fxspeed.models.gpt import GPT, GPTConfig


EDITED = "blocks.0.mlp.fc.weight"


def model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig.preset("tiny"))


def batches(rank: int, world: int, n: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    full = [torch.randint(0, 256, (4 * world, 16), generator=g) for _ in range(n)]
    return [(b[4 * rank:4 * rank + 4], b[4 * rank:4 * rank + 4]) for b in full]


def run(cfg: fxspeed.Config, world: int, rank: int, save: str | None = None) -> dict:
    data = batches(rank, world)
    engine = fxspeed.compile(model(), world, cfg, example_inputs=data[0])
    losses = []
    for i, b in enumerate(data):
        if save and i == len(data) - 1:
            engine.save(save)  # before the last step: a resumed engine must take the same last step
        losses.append(engine.train_step(*b))
    flat = engine._flat
    out: dict = {"losses": losses, "eval": engine.eval_step(*data[0])}
    out["layout"] = {"master": flat.master, "working": sorted({str(t.dtype) for t in flat.work_shards}),
                     "masters": sorted({str(t.dtype) for t in flat.shards}),
                     "grads": sorted({b.dtype for b in flat.buckets}),
                     "module_empty": all(p.numel() == 0 for p in engine.model.parameters())}
    out["state"] = {k: v.detach().clone() for k, v in engine.state_dict().items()}
    with engine.gathered():
        out["gathered_dtypes"] = sorted({str(p.dtype) for p in engine.model.parameters()})
    # an edit inside gathered() (the same on every rank) is kept: halving is exact in any precision
    with engine.gathered(), torch.no_grad():
        dict(engine.model.named_parameters())[EDITED].mul_(0.5)
    out["edited"] = {k: v.detach().clone() for k, v in engine.state_dict().items()}
    out["edited_loss"] = engine.eval_step(*data[0])
    return out


def resume(cfg: fxspeed.Config, world: int, rank: int, directory: str) -> float:
    data = batches(rank, world)
    engine = fxspeed.compile(model(), world, cfg, example_inputs=data[0])
    engine.load(directory)
    return engine.train_step(*data[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(1)
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    lr = dict(lr=1e-2)
    configs = {
        "fp32": fxspeed.Config(zero=2, **lr),
        "zero0": fxspeed.Config(zero=0, precision="bf16", **lr),
        "zero1": fxspeed.Config(zero=1, precision="bf16", **lr),
        "zero2": fxspeed.Config(zero=2, precision="bf16", bucket_mb=0.05, **lr),
        "zero3": fxspeed.Config(zero=3, precision="bf16", bucket_mb=0.05, **lr),
        "zero2_fp32_grads": fxspeed.Config(zero=2, precision="bf16", reduce_dtype="fp32", **lr),
        "zero0_fp16": fxspeed.Config(zero=0, precision="fp16", **lr),
        "zero2_fp16": fxspeed.Config(zero=2, precision="fp16", **lr),
        "zero0_accum_clip": fxspeed.Config(zero=0, precision="bf16", grad_accum=2, grad_clip=0.5, **lr),
        "zero1_accum_clip": fxspeed.Config(zero=1, precision="bf16", grad_accum=2, grad_clip=0.5, **lr),
    }
    ckpt = os.path.join(a.out, "ckpt")
    res = {name: run(cfg, world, rank, save=ckpt if name == "zero2" else None) for name, cfg in configs.items()}
    res["resumed_zero3"] = resume(configs["zero3"], world, rank, ckpt)
    res["resumed_zero0"] = resume(configs["zero0"], world, rank, ckpt)
    torch.save(res, os.path.join(a.out, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
