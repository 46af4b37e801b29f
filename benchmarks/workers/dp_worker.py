"""Run under torch.distributed.run (gloo, CPU): train one or more data-parallel configurations of
the same GPT on this rank and record step times, losses and peak RSS growth.

Configurations (--configs, comma separated, run in the given order in this process):

    ddp        torch DistributedDataParallel (gloo, default 25 MB buckets)
    fx0..fx3   fxspeed.compile(..., Config(zero=k, optimizer="adam"))
    fsdp2      torch.distributed.fsdp.fully_shard on every transformer block, then on the root
    ds1..ds3   DeepSpeed ZeRO stage k (DS_ACCELERATOR=cpu, torch Adam)

Every configuration: same model (seed 0), torch Adam (lr 1e-4; fused kernel, as fxspeed's runtime
uses, except DeepSpeed's own optimizer wrapper), same local
batch per rank and step, one intra-op thread. A step is forward + backward + optimizer step +
zero grad + the global-batch loss (all-reduced mean over ranks, as fxspeed's train_step returns),
so every row does the same work and ends on the same synchronization.

Memory: after the model is built the rank reads VmRSS and resets the kernel's peak counter
(/proc/self/clear_refs); after the last step VmHWM - baseline is the peak growth the
configuration added (wrapping, compiling, gradients, optimizer state, buckets, activations).
The launcher sets MALLOC_MMAP_THRESHOLD_ so freed tensors go back to the OS.

Writes one JSON file per (config, rank) into --out.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time

import torch
import torch.distributed as dist

LR = 1e-4


def status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := current VmRSS


def build(preset: str) -> torch.nn.Module:
    from fxspeed.models import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig.preset(preset))


def batch(rank: int, step: int, b: int, t: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randint(0, vocab, (b, t), generator=g)
    y = torch.randint(0, vocab, (b, t), generator=g)
    return x, y


def global_loss(loss: torch.Tensor, world: int) -> float:
    t = loss.detach().clone()
    dist.all_reduce(t)
    return float(t) / world


# --- one step function per framework -----------------------------------------------------------
def setup(kind: str, model: torch.nn.Module, example: tuple, world: int):  # noqa: ANN201
    """Wrap `model` for `kind`; return (step(x, y) -> global loss, handles to keep alive)."""
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        ddp = DDP(model)
        opt = torch.optim.Adam(ddp.parameters(), lr=LR, fused=True)

        def step(x, y):  # noqa: ANN001, ANN202
            loss = ddp(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return global_loss(loss, world)

        return step, (ddp, opt)
    if kind.startswith("fx"):
        import fxspeed

        engine = fxspeed.compile(model, world, fxspeed.Config(zero=int(kind[2:]), optimizer="adam", lr=LR),
                                 example_inputs=example)
        return engine.train_step, (engine,)
    if kind == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.Adam(model.parameters(), lr=LR, fused=True)

        def step(x, y):  # noqa: ANN001, ANN202
            loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return global_loss(loss, world)

        return step, (model, opt)
    if kind.startswith("ds"):
        import deepspeed

        b = example[0].shape[0]
        cfg = {"train_micro_batch_size_per_gpu": b, "train_batch_size": b * world, "gradient_accumulation_steps": 1,
               "optimizer": {"type": "Adam", "params": {"torch_adam": True, "lr": LR}},
               "zero_optimization": {"stage": int(kind[2:])}, "steps_per_print": 10**9, "wall_clock_breakdown": False}
        eng, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)

        def step(x, y):  # noqa: ANN001, ANN202
            loss = eng(x, y)
            eng.backward(loss)
            eng.step()
            return global_loss(loss, world)

        return step, (eng,)
    raise ValueError(f"unknown config {kind!r}")


def run(kind: str, a: argparse.Namespace, rank: int, world: int, record: bool = True) -> dict:
    preset = a.preset
    model = build(preset)
    vocab = model.config.vocab_size
    n_params = sum(p.numel() for p in model.parameters())
    batches = [batch(rank, s, a.batch, a.seq, vocab) for s in range(a.warmup + a.steps)]
    gc.collect()
    dist.barrier()
    base = status_kb("VmRSS")
    reset_peak()
    t0 = time.perf_counter()
    step, keep = setup(kind, model, batches[0], world)
    setup_s = time.perf_counter() - t0
    times, losses = [], []
    for s, (x, y) in enumerate(batches):
        t = time.perf_counter()
        losses.append(step(x, y))
        times.append(time.perf_counter() - t)
    peak = status_kb("VmHWM")
    end = status_kb("VmRSS")
    rec = {"config": kind, "rank": rank, "world": world, "preset": preset, "params": n_params,
           "local_batch": [a.batch, a.seq], "threads": torch.get_num_threads(), "warmup": a.warmup,
           "setup_s": setup_s, "step_times_s": times[a.warmup:], "warmup_times_s": times[:a.warmup],
           "losses": losses, "baseline_rss_bytes": base * 1024, "peak_rss_bytes": peak * 1024,
           "end_rss_bytes": end * 1024, "peak_growth_bytes": (peak - base) * 1024}
    del step, keep, model
    gc.collect()
    if record:
        with open(os.path.join(a.out, f"{kind}_rank{rank}.json"), "w") as f:
            json.dump(rec, f)
    return rec


def paired(kinds: list[str], a: argparse.Namespace, rank: int, world: int) -> None:
    """kinds[0] (the reference, DDP) stays alive; every other config is built after it and its
    timed steps alternate with the reference's (ref, X, X, ref, ...), so load changes on a shared
    machine hit both alike. Peak growth of each config is measured over its setup and warmup
    steps, the reference idle (its memory is in the baseline)."""
    ref_kind, others = kinds[0], kinds[1:]
    model = build(a.preset)
    vocab = model.config.vocab_size
    n = a.warmup + a.steps
    batches = [batch(rank, s, a.batch, a.seq, vocab) for s in range(n)]
    ref_losses: list[float] = []

    def measure(kind: str, m: torch.nn.Module) -> tuple:
        gc.collect()
        dist.barrier()
        base = status_kb("VmRSS")
        reset_peak()
        t0 = time.perf_counter()
        step, keep = setup(kind, m, batches[0], world)
        setup_s = time.perf_counter() - t0
        losses, warm = [], []
        for x, y in batches[:a.warmup]:
            t = time.perf_counter()
            losses.append(step(x, y))
            warm.append(time.perf_counter() - t)
        peak = status_kb("VmHWM")
        return step, keep, {"config": kind, "rank": rank, "world": world, "preset": a.preset,
                            "local_batch": [a.batch, a.seq], "threads": torch.get_num_threads(),
                            "warmup": a.warmup, "setup_s": setup_s, "warmup_times_s": warm, "losses": losses,
                            "baseline_rss_bytes": base * 1024, "peak_rss_bytes": peak * 1024,
                            "peak_growth_bytes": (peak - base) * 1024, "step_times_s": [], "ref_step_times_s": []}

    n_params = sum(p.numel() for p in model.parameters())
    ref_step, ref_keep, ref_rec = measure(ref_kind, model)
    ref_rec["params"] = n_params
    ref_losses += ref_rec["losses"]
    ref_i = a.warmup
    for kind in others:
        m = build(a.preset)
        step, keep, rec = measure(kind, m)
        rec["params"] = n_params
        for s in range(a.warmup, n):
            x, y = batches[s]
            for which in (("ref", "x") if s % 2 == 0 else ("x", "ref")):
                t = time.perf_counter()
                if which == "x":
                    rec["losses"].append(step(x, y))
                    rec["step_times_s"].append(time.perf_counter() - t)
                else:
                    rx, ry = batches[ref_i % n]
                    loss = ref_step(rx, ry)
                    rec["ref_step_times_s"].append(time.perf_counter() - t)
                    if ref_i < n:
                        ref_losses.append(loss)
                    ref_i += 1
        ref_rec["step_times_s"] += rec["ref_step_times_s"]
        with open(os.path.join(a.out, f"{kind}_rank{rank}.json"), "w") as f:
            json.dump(rec, f)
        del step, keep, m
        gc.collect()
    ref_rec["losses"] = ref_losses[:n]
    with open(os.path.join(a.out, f"{ref_kind}_rank{rank}.json"), "w") as f:
        json.dump(ref_rec, f)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", required=True)
    ap.add_argument("--preset", default="100m")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--no-tiny-warmup", action="store_true",
                    help="skip the untimed tiny-model run that loads each framework's code first")
    ap.add_argument("--paired", action="store_true",
                    help="keep the first config alive and alternate its steps with each other config's")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(1)
    kinds = a.configs.split(",")
    if any(k.startswith("ds") for k in kinds):
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
    else:
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if not a.no_tiny_warmup and a.preset != "tiny":
        # Code loaded on first use (tracing machinery, wrappers, collectives) is not charged
        # to the measured runs' memory.
        tiny = argparse.Namespace(**{**vars(a), "preset": "tiny", "warmup": 0, "steps": 1, "seq": 16})
        for kind in kinds:
            run(kind, tiny, rank, world, record=False)
    if a.paired:
        paired(kinds, a, rank, world)
        kinds = []
    for kind in kinds:
        run(kind, a, rank, world)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
