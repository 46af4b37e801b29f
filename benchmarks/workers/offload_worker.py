"""Run under torch.distributed.run (gloo, CPU): train fxspeed's GPT with Config(zero=Z) with or
without offload to files (--mode plain | nvme | params | all: none, the optimizer, the ZeRO-3
working parameter shards, both), record step times and peak RSS.

A step is engine.train_step (forward, backward, reduction, optimizer step; with --mode nvme the
Adam moments are read from and written to --nvme-path around the update). The slowest rank's step
time is taken (an all-reduce MAX after each step). Memory: VmHWM of the process at the end (the
kernel's counter, nothing of ours), and VmRSS right after the model is built. Writes
{mode}_rank{r}.json into --out.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time

import torch
import torch.distributed as dist

import fxspeed
from benchmarks.workers.dp_worker import reset_peak, status_kb
from fxspeed.models import GPT, GPTConfig


# fxspeed's modes -> Config.offload: "nvme" the optimizer tier (Adam's moments, and under bf16/fp16
# the fp32 masters), "params" the parameter tier (ZeRO-3 working shards), "all" both.
MODES = {"plain": "none", "nvme": "optimizer", "params": "parameters", "all": "all"}
# "<mode>_end": the same with the optimizer stepped after the program instead of per gradient
# bucket inside backward (passes/memory/step_buckets_in_backward.py, step_in_backward.py)
MODES.update({f"{m}_end": v for m, v in list(MODES.items())})
AT_THE_END = ("step_in_backward", "step_buckets_in_backward")


def deepspeed_step(model: torch.nn.Module, a: argparse.Namespace, world: int):  # noqa: ANN201
    """DeepSpeed ZeRO-`a.zero` with offload_optimizer to the CPU (its CPU Adam, JIT-built on first
    use; DS_ACCELERATOR=cpu): DeepSpeed's ZeRO-Offload on this machine."""
    import deepspeed

    cfg = {"train_micro_batch_size_per_gpu": a.batch, "train_batch_size": a.batch * world,
           "gradient_accumulation_steps": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
           "zero_optimization": {"stage": a.zero, "offload_optimizer": {"device": "cpu"}},
           "steps_per_print": 10**9, "wall_clock_breakdown": False}
    eng, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        loss = eng(x, y)
        eng.backward(loss)
        eng.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        return float(mean) / world

    return step, eng


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=tuple(MODES) + ("ds",), required=True)
    ap.add_argument("--layers", type=int, default=27)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--zero", type=int, default=2)
    ap.add_argument("--precision", default="fp32", help="fp32, or bf16/fp16 (with zero >= 1: fp32 masters in the file)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--nvme-path", default="/tmp")
    ap.add_argument("--out", required=True)
    ap.add_argument("--meta", action="store_true", help="build on the meta device (compile materializes it)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    if a.mode == "ds":
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
    else:
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    if a.meta and a.mode == "ds":
        raise SystemExit("--meta: DeepSpeed's engine takes a built model")
    with fxspeed.parameters_on_meta() if a.meta else contextlib.nullcontext():
        model = GPT(GPTConfig(vocab_size=8192, block_size=a.seq, n_layer=a.layers, n_head=a.width // 64, n_embd=a.width))
    n_params = sum(p.numel() for p in model.parameters())
    rss_model = status_kb("VmRSS")
    g = torch.Generator().manual_seed(rank)
    x = torch.randint(0, 8192, (a.batch, a.seq), generator=g)
    y = torch.randint(0, 8192, (a.batch, a.seq), generator=g)
    if a.mode == "ds":
        step_fn, engine = deepspeed_step(model, a, world)
    else:
        extra = dict(offload=MODES[a.mode], nvme_path=a.nvme_path) if MODES[a.mode] != "none" else {}
        if a.mode.endswith("_end"):
            extra["disable_passes"] = AT_THE_END
        engine = fxspeed.compile(model, world, fxspeed.Config(zero=a.zero, lr=1e-4, precision=a.precision, **extra),
                                 example_inputs=(x, y))
        step_fn = engine.train_step
    rss_compiled = status_kb("VmRSS")  # after the engine laid out its state (the masters in the file)
    # The peak so far is building the user's fp32 model and laying it out; from here on, training's.
    peak_build = status_kb("VmHWM")
    reset_peak()
    times, losses = [], []
    for step in range(a.warmup + a.steps):
        t = time.perf_counter()
        losses.append(step_fn(x, y))
        dt = torch.tensor(time.perf_counter() - t, dtype=torch.float64)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        if step >= a.warmup:
            times.append(float(dt))
    record = {"mode": a.mode, "meta": a.meta, "rank": rank, "world": world, "n_params": n_params, "zero": a.zero,
              "precision": a.precision, "rss_after_compile_kb": rss_compiled,
              "tokens_per_rank": a.batch * a.seq, "step_times_s": times, "losses": losses,
              "rss_after_model_kb": rss_model, "peak_rss_kb": max(peak_build, status_kb("VmHWM")),
              "peak_rss_build_kb": peak_build, "peak_rss_train_kb": status_kb("VmHWM"),
              "optimizer": getattr(engine.optimizer, "stats", {}),
              # fxspeed's own prediction of this rank's peak, to set beside the kernel's VmHWM
              "plan_peak_bytes": engine.plan.peak_memory() if getattr(engine, "plan", None) is not None else None}
    with open(f"{a.out}/{a.mode}_rank{rank}.json", "w") as f:
        json.dump(record, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
